"""Emulated datacenters joined by a WAN, with real kernel networking (root only).

Topology for a cluster with DCs 0..n-1:

    gt-<tag>-0east  [gt0 10.77.1.2] --veth-- [gtd0 10.77.1.1]
    gt-<tag>-1west  [gt0 10.77.2.2] --veth-- [gtd1 10.77.2.1]   gt-<tag> (router namespace)
                                                             + gttun (TUN) <-> delayer process

In the router, `ip rule iif gtdI lookup 100` sends every forwarded packet into the TUN, the delayer
holds it for its link's one-way latency and writes it back, the main table forwards it to the
destination port, whose htb (see `htb`) applies the link capacity and per-connection cap.
Each direction is delayed and shaped separately, so RTT = 2 x latency_ms, as on a real link.

Processes of a DC run inside its namespace (`popen`/`exec_in`) and talk real TCP: gloo with
MASTER_ADDR = `address(master_dc)` and GLOO_SOCKET_IFNAME = `ifname(dc)`, or the project's own
sockets. On a GPU box each DC is also its own NCCL host (`nccl.nccl_host_env`), so NCCL between DCs
takes the NET transport over that interface instead of P2P/SHM. Tear-down (context exit, atexit,
SIGTERM/SIGHUP/SIGINT) removes the processes inside the namespaces, the namespaces and the state
file; see `netns` for stale-run cleanup.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from geotrain.emulation import netns as N
from geotrain.emulation.htb import emulation_mtu, htb_commands
from geotrain.emulation.nccl import nccl_host_env
from geotrain.errors import GeotrainError
from geotrain.spec import Cluster

ROUTE_TABLE = "100"


class WanUnavailable(GeotrainError):
    """Kernel WAN emulation is not possible here (not root, no namespaces, no TUN)."""


def emulation_available() -> tuple[bool, str]:
    """(True, "") where namespaces can be made, else (False, why) -- the caller then falls back to
    the shaper inside StripedTransport (delay and rate limits in user space)."""
    if os.geteuid() != 0:
        return False, "not root"
    if not os.path.exists("/dev/net/tun"):
        return False, "no /dev/net/tun"
    try:
        subprocess.run(["ip", "-V"], capture_output=True, check=True)
        subprocess.run(["tc", "-V"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return False, "iproute2 (ip, tc) not installed"
    return True, ""


def cluster_tag(cluster: Cluster, unique: bool) -> str:
    """6 hex digits from the cluster (and, for API use, this process), keeping names short."""
    text = cluster.model_dump_json()
    if unique:
        text += f"{os.getpid()}-{time.time_ns()}"
    return hashlib.sha1(text.encode()).hexdigest()[:6]


_ACTIVE: list[WanEmulation] = []
_HANDLERS_INSTALLED = False


def _teardown_all() -> None:
    for w in list(_ACTIVE):
        w.stop()


def _on_signal(signum, frame):
    _teardown_all()
    prev = _PREV_HANDLERS.get(signum)
    if callable(prev):
        prev(signum, frame)
    elif signum == signal.SIGINT:
        raise KeyboardInterrupt
    else:
        raise SystemExit(128 + signum)


_PREV_HANDLERS: dict[int, object] = {}


def _install_handlers() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(_teardown_all)
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGHUP):
            _PREV_HANDLERS[s] = signal.getsignal(s)
            signal.signal(s, _on_signal)
        # SIGINT stays Python's KeyboardInterrupt, which unwinds through __exit__.


class WanEmulation:
    """`with WanEmulation(cluster) as wan: wan.popen(dc, argv, env)` -- see the module docstring.

    rate_scale multiplies every capacity and per-connection cap (the Python delayer tops out
    around 1-2 Gbit/s, so a spec with 100 Gbit/s links is emulated scaled down); latency is exact.
    manual=True (the CLI) makes a set-up that outlives this process until `down` or `lifetime_s`.
    """

    def __init__(self, cluster: Cluster, *, rate_scale: float = 1.0, lifetime_s: float = 3600.0,
                 manual: bool = False, tag: str | None = None, verbose: bool = False,
                 queue_bdp: float | None = 1.0):
        self.cluster = cluster
        self.rate_scale = rate_scale
        self.lifetime_s = lifetime_s
        self.manual = manual
        self.verbose = verbose
        self.queue_bdp = queue_bdp
        self.tag = tag or cluster_tag(cluster, unique=not manual)
        self.dcs = [dc.name for dc in cluster.datacenters]
        self.state = N.WanState(
            tag=self.tag, router=N.router_ns(self.tag),
            namespaces=[N.dc_ns(self.tag, i, d) for i, d in enumerate(self.dcs)], dcs=list(self.dcs),
            owner_pid=None if manual else os.getpid(),
            owner_start=None if manual else N.process_start_time(os.getpid()),
            lifetime_s=lifetime_s,
        )
        # Packets small enough that htb paces a message at its cap (htb.emulation_mtu).
        self.mtu = emulation_mtu([min(wl.per_connection_gbps, wl.capacity_gbps) * rate_scale
                                  for wl in cluster.wan_links])
        self.delayer: subprocess.Popen | None = None
        self.failed: str | None = None
        self._procs: list[subprocess.Popen] = []
        self._stopping = threading.Event()
        self._started = False
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- lookups
    def _index(self, dc: str) -> int:
        try:
            return self.dcs.index(dc)
        except ValueError:
            raise GeotrainError(f"unknown datacenter {dc!r} (known: {', '.join(self.dcs)})") from None

    def address(self, dc: str) -> str:
        """The DC's IPv4 address (all of its ranks share it; use it as MASTER_ADDR or to listen)."""
        return N.dc_address(self._index(dc))

    def ifname(self, dc: str) -> str:
        """The DC namespace's WAN-facing interface (GLOO_SOCKET_IFNAME)."""
        self._index(dc)
        return N.DC_IFNAME

    def host_env(self, dc: str, inherited: Mapping[str, str] | None = None) -> dict[str, str]:
        """What makes every process started in `dc` one host of its own: gloo's interface and NCCL's
        host identity (`nccl.nccl_host_env`); a NCCL_* variable already in `inherited` (default: this
        process's environment, which the ranks inherit) is left as the user set it."""
        return {"GLOO_SOCKET_IFNAME": self.ifname(dc),
                **nccl_host_env(f"geotrain-{self.tag}-{dc}", self.ifname(dc),
                                os.environ if inherited is None else inherited)}

    def rank_env(self, dc: str, master_dc: str, master_port: int = 29500,
                 inherited: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a torch.distributed rank running in `dc` (gloo or NCCL across namespaces)."""
        return {"MASTER_ADDR": self.address(master_dc), "MASTER_PORT": str(master_port),
                **self.host_env(dc, inherited)}

    def netns(self, dc: str) -> str:
        return self.state.namespaces[self._index(dc)]

    # ---------------------------------------------------------------- running things inside a DC
    def _argv(self, dc: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns(dc), *argv]

    def exec_in(self, dc: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
                timeout: float | None = None, check: bool = False) -> subprocess.CompletedProcess:
        self.check()
        return subprocess.run(self._argv(dc, argv), env=self._env(env), capture_output=True, text=True,
                              timeout=timeout, check=check)

    def popen(self, dc: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start `argv` inside the DC's namespace; it is killed at tear-down if still running."""
        self.check()
        p = subprocess.Popen(self._argv(dc, argv), env=self._env(env), **kw)
        self._procs.append(p)
        return p

    @staticmethod
    def _env(env: Mapping[str, str] | None) -> dict[str, str] | None:
        return None if env is None else {**os.environ, **env}

    # ---------------------------------------------------------------- life cycle
    def __enter__(self) -> WanEmulation:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> WanEmulation:
        ok, why = emulation_available()
        if not ok:
            raise WanUnavailable(f"cannot emulate the WAN with network namespaces ({why})")
        N.clean_stale()
        clash = set(self.state.all_namespaces()) & N.existing_namespaces()
        if clash:
            raise WanUnavailable(f"namespaces {', '.join(sorted(clash))} already exist "
                                 f"(another emulation? `geotrain wan down` removes it)")
        _install_handlers()
        self.state.save()               # before creating anything, so a crash is always cleanable
        _ACTIVE.append(self)
        try:
            self._build()
            self._start_delayer()
        except BaseException as e:
            self.stop()
            if isinstance(e, RuntimeError):
                raise WanUnavailable(f"WAN emulation set-up failed: {e}") from None
            raise
        self._started = True
        if not self.manual:
            threading.Thread(target=self._watch, name="wan-delayer-watchdog", daemon=True).start()
        return self

    def _build(self) -> None:
        st = self.state
        N.run_ip("netns", "add", st.router)
        N.ns_exec(st.router, ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
                              "net.ipv4.conf.default.rp_filter=0"])
        N.run_ip("link", "set", "lo", "up", ns=st.router)
        N.run_ip("tuntap", "add", "dev", N.TUN_IFNAME, "mode", "tun", ns=st.router)
        N.run_ip("link", "set", N.TUN_IFNAME, "mtu", str(self.mtu), "txqueuelen", "2000", "up", ns=st.router)
        N.run_ip("route", "add", "default", "dev", N.TUN_IFNAME, "table", ROUTE_TABLE, ns=st.router)
        hosts = {N.hostname(dc): N.dc_address(i) for i, dc in enumerate(self.dcs)}
        for ns in st.all_namespaces():
            N.write_name_files(ns, hosts)
        for i, ns in enumerate(st.namespaces):
            N.run_ip("netns", "add", ns)
            N.run_ip("link", "set", "lo", "up", ns=ns)
            rif = N.router_ifname(i)
            N.run_ip("link", "add", rif, "mtu", str(self.mtu), "type", "veth", "peer", "name", N.DC_IFNAME,
                     "mtu", str(self.mtu), "netns", ns, ns=st.router)
            N.run_ip("addr", "add", f"{N.router_address(i)}/24", "dev", rif, ns=st.router)
            N.run_ip("link", "set", rif, "up", ns=st.router)
            N.run_ip("addr", "add", f"{N.dc_address(i)}/24", "dev", N.DC_IFNAME, ns=ns)
            N.run_ip("link", "set", N.DC_IFNAME, "up", ns=ns)
            N.run_ip("route", "add", "default", "via", N.router_address(i), ns=ns)
            N.run_ip("rule", "add", "iif", rif, "lookup", ROUTE_TABLE, "pref", "100", ns=st.router)
        for i, dc in enumerate(self.dcs):
            sources = []
            for j, other in enumerate(self.dcs):
                link = self.cluster.link(dc, other) if i != j else None
                if link is not None:
                    sources.append((j, N.dc_subnet(j), link.capacity_gbps * self.rate_scale,
                                    link.per_connection_gbps * self.rate_scale))
            if sources:
                batch = "\n".join(" ".join(c) for c in htb_commands(N.router_ifname(i), sources, self.mtu,
                                                                     self._queue_bytes(dc))) + "\n"
                r = subprocess.run(["tc", "-n", st.router, "-batch", "-"], input=batch, capture_output=True,
                                   text=True)
                if r.returncode != 0:
                    raise RuntimeError(f"tc: {r.stderr.strip()}")

    def _queue_bytes(self, dc: str) -> int | None:
        """Router buffer per leaf: `queue_bdp` bandwidth-delay products of the largest link into `dc`."""
        if not self.queue_bdp:
            return None
        bdps = [ln.capacity_gbps * self.rate_scale * 1e9 / 8 * 2 * ln.latency_ms / 1e3
                for ln in self.cluster.wan_links if dc in ln.between]
        return int(self.queue_bdp * max(bdps, default=0))

    def _links_json(self) -> str:
        out = []
        for link in self.cluster.wan_links:
            a, b = (self.dcs.index(x) + 1 for x in link.between)
            out.append({"a": a, "b": b, "latency_ms": link.latency_ms, "jitter_ms": link.jitter_ms,
                        "loss": link.loss})
        return json.dumps(out)

    def _start_delayer(self) -> None:
        argv = [sys.executable, "-m", "geotrain.emulation.delayer", "--tun", N.TUN_IFNAME,
                "--links", self._links_json(), "--lifetime", str(self.lifetime_s), "--state", str(self.state.path)]
        if self.state.owner_pid is not None:
            argv += ["--owner-pid", str(self.state.owner_pid)]
        # A manual set-up outlives this process: its delayer must not hold our stderr (a caller
        # capturing our output would wait for it), so it logs next to the state file.
        log = open(self.state.path.with_suffix(".log"), "a") if self.manual else None   # noqa: SIM115
        p = subprocess.Popen(["ip", "netns", "exec", self.state.router, *argv], stdout=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, stderr=log, start_new_session=True, text=True)
        if log is not None:
            log.close()
        line = p.stdout.readline() if p.stdout else ""
        if line.strip() != "ready":
            p.kill()
            raise RuntimeError(f"packet delayer did not start (exit {p.wait()})")
        self.delayer = p
        self.state.delayer_pid = p.pid
        self.state.save()

    def _watch(self) -> None:
        """Restart a dead delayer (a dead one black-holes all WAN traffic); give up loudly after 3."""
        restarts = 0
        while not self._stopping.wait(0.2):
            p = self.delayer
            if p is None or p.poll() is None:
                continue
            if self._stopping.is_set():
                return
            restarts += 1
            msg = f"geotrain wan: packet delayer died (exit {p.returncode}); WAN traffic is dropped until it restarts"
            print(msg, file=sys.stderr)
            if restarts > 3:
                self.failed = msg
                return
            try:
                with self._lock:
                    if not self._stopping.is_set():
                        self._start_delayer()
            except (RuntimeError, OSError) as e:
                self.failed = f"{msg}; restart failed: {e}"
                print(self.failed, file=sys.stderr)
                return

    def check(self) -> None:
        """Raise if the emulation is broken (its delayer died for good)."""
        if self.failed:
            raise GeotrainError(self.failed)

    def link_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes each DC has sent over its WAN link ("out") and received from it ("in") so far:
        the router's side of the DC's veth (its rx is what the DC sent). A DC's ranks share one
        address, so their traffic with each other never reaches the router: these are cross-DC
        bytes only -- what a run really put on the emulated WAN, whichever library sent it."""
        out = {}
        for i, dc in enumerate(self.dcs):
            try:
                stats = json.loads(N.run_ip("-s", "-j", "link", "show", "dev", N.router_ifname(i),
                                            ns=self.state.router))[0]["stats64"]
            except (RuntimeError, ValueError, LookupError):
                continue                    # torn down already, or an ip without JSON: no count
            out[dc] = {"out": int(stats["rx"]["bytes"]), "in": int(stats["tx"]["bytes"])}
        return out

    def delayer_alive(self) -> bool:
        return self.delayer is not None and self.delayer.poll() is None

    def stop(self) -> None:
        """Tear everything down; idempotent, safe from signal handlers and atexit."""
        self._stopping.set()
        with self._lock:
            for p in self._procs:
                if p.poll() is None:
                    p.terminate()
            for p in self._procs:
                try:
                    p.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            self._procs.clear()
            if self.delayer is not None and self.delayer.poll() is None:
                self.delayer.terminate()
                try:
                    self.delayer.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    self.delayer.kill()
                    self.delayer.wait()
            N.teardown(self.state)
            if self in _ACTIVE:
                _ACTIVE.remove(self)

    def detach(self) -> None:
        """For `geotrain wan up`: leave the set-up running after this process exits."""
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self._stopping.set()

    def describe(self) -> str:
        lines = [f"WAN emulation {self.tag}: router namespace {self.state.router}"]
        for i, dc in enumerate(self.dcs):
            lines.append(f"  {dc}: namespace {self.state.namespaces[i]}, address {N.dc_address(i)}, "
                         f"interface {N.DC_IFNAME}")
        for link in self.cluster.wan_links:
            lines.append(f"  link {link.between[0]}-{link.between[1]}: {link.latency_ms} ms one-way, "
                         f"{link.capacity_gbps * self.rate_scale:g} Gbit/s, "
                         f"{link.per_connection_gbps * self.rate_scale:g} Gbit/s per connection")
        return "\n".join(lines)
