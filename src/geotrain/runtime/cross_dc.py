"""The WAN in real training: where ranks run, and how their cross-DC transfers travel.

Launcher side (`open_wan`): `--wan kernel` starts every rank inside its DC's network namespace of
the emulated WAN (geotrain.emulation); `--wan shaper` keeps ranks on 127.0.0.1 and shapes inside
the transport; `auto` picks kernel where it can. Under torchrun `--wan auto` runs the same
transport over the real network ("direct": `bind_address`); `--wan off` is plain gloo/NCCL.

Rank side (`rank_run.build_transport`, which needs torch): pairs inside a DC keep gloo/NCCL; pairs across a WAN link go
through StripedTransport with the LinkPlan's connections, taking turns when it says "temporal".
Turns cannot deadlock: every replica posts the same sends in the same order, sends are
non-blocking and receivers buffer, so a turn waits only for messages posted without waiting on it
(`sends_per_boundary` checks the first claim); a dead peer ends the run by timeout, named.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from geotrain.emulation.network import WanEmulation, WanUnavailable, emulation_available
from geotrain.errors import GeotrainError
from geotrain.layout.plan import LinkPlan
from geotrain.runtime.train_config import DEFAULT_OUTAGE_LIMIT_S, WanConfig
from geotrain.schedule.actions import Op

MODES = ("auto", "kernel", "shaper", "off")
RANK_MODES = ("kernel", "shaper", "direct")    # what a rank's wan config may say ("direct": a real WAN)
DELAYER_GBPS = 1.0       # what the Python packet delayer carries comfortably (see environment notes)
MIN_CHUNK_BYTES = 4096   # small stripes: a tiny model's boundary tensor (tens of KB) still uses every connection
DEFAULT_TIMEOUT_S = DEFAULT_OUTAGE_LIMIT_S
DEFAULT_STALL_S = 30.0   # a cross-DC transfer without progress this long is reported by name while it waits


# ----------------------------------------------------------------------------- plan helpers
def peer_stages(plan, schedule, stage: int) -> set[int]:
    """Physical stages this stage exchanges boundary tensors with (from its action list)."""
    return {a.peer % plan.pp for a in schedule.actions[stage] if a.peer >= 0 and a.peer % plan.pp != stage}


def cross_dc_links(plan, schedule, stage: int, replica: int = 0):
    """{peer stage: LinkPlan} for this stage's peers in another DC (a missing LinkPlan: 1 connection, fair).
    Boundary tensors stay inside one DP pipeline, so the DCs compared are that pipeline's: a region
    plan's pipeline is whole inside one DC and has none."""
    mine = plan.dc_of(stage, replica)
    out = {}
    for p in sorted(peer_stages(plan, schedule, stage)):
        other = plan.dc_of(p, replica)
        if other != mine:
            out[p] = plan.link_between(mine, other) or LinkPlan(src_dc=mine, dst_dc=other)
    return out


def turn_order(lp, dp: int) -> list[int]:
    order = list(lp.order) or list(range(dp))
    if sorted(order) != list(range(dp)):
        raise GeotrainError(f"link {lp.src_dc}-{lp.dst_dc}: temporal order {order} must list each of the "
                            f"{dp} DP pipelines exactly once")
    return order


def sends_per_boundary(plan, schedule) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """Per (sending stage, receiving stage): the sends one replica makes per iteration, in order,
    as (kind, virtual stage, micro-batch). Every replica runs the same list, so temporal turns
    (one message per replica per round) stay matched; tests check it holds for every schedule."""
    out: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for s, actions in enumerate(schedule.actions):
        for a in actions:
            if a.op in (Op.SEND_ACT, Op.SEND_GRAD) and a.peer % plan.pp != s:
                out.setdefault((s, a.peer % plan.pp), []).append((a.op.value, a.stage, a.mb))
    return out


def start_delay(plan, replica: int) -> float:
    """Seconds pipeline `replica` waits before its first step: the plan's pipeline offset (the
    simulator starts every rank of DP pipeline d at pipeline_offsets[d], once, at time 0)."""
    offs = plan.pipeline_offsets
    return float(offs[replica]) if replica < len(offs) else 0.0


# ----------------------------------------------------------------------------- rank side
def bind_address(explicit: str | None = None) -> str:
    """The address this host's WAN transport listens on and connects from: `explicit` (--wan-bind),
    else the local address of the route to the rendezvous host (MASTER_ADDR) -- the interface the
    other hosts already reach this one through."""
    if explicit:
        try:
            socket.inet_aton(explicit)
        except OSError:
            raise GeotrainError(f"--wan-bind: {explicit!r} is not an IPv4 address") from None
        return explicit
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))   # UDP: nothing is sent
            return s.getsockname()[0]
    except (OSError, ValueError) as e:
        raise GeotrainError(f"cannot tell this host's address towards MASTER_ADDR={master} ({e}); "
                            "pass --wan-bind ADDR") from None


class RecordedTurns:
    """One pipeline's turns on a link direction, each turn it held recorded as a `turn` event
    (granted -> released) in the rank's trace: the measured trace shows the turns the transport
    took, not only the plan's intent (`geotrain rehearse` counts them per link)."""

    def __init__(self, inner, recorder, link: str, stage: int):
        self.inner, self.recorder, self.link, self.stage = inner, recorder, link, stage
        self.handoff = getattr(inner, "handoff", None)      # when the transport may pass the turn on
        self._granted: dict[int, float] = {}        # per sending thread (one per peer)

    def acquire(self) -> None:
        self.inner.acquire()
        self._granted[threading.get_ident()] = time.time()

    def release(self) -> None:
        end = time.time()        # before the link is handed on: the next holder's turn starts after it
        t = self._granted.pop(threading.get_ident(), None)
        self.inner.release()
        if t is not None and self.recorder is not None:
            t0 = self.recorder.t0
            self.recorder.add("turn", t - t0, end - t0, stage=self.stage, link=self.link)

    def leave(self) -> None:
        self.inner.leave()

    def close(self) -> None:
        if hasattr(self.inner, "close"):
            self.inner.close()


# ----------------------------------------------------------------------------- launcher side
@dataclass
class WanLaunch:
    """What the launcher needs: the rank-side config, where each rank runs, and tear-down."""

    mode: str                                   # "kernel" | "shaper" | "off"
    rank_dc: list[str] = field(default_factory=list)
    emulation: Any = None                       # geotrain.transport.WanEmulation when mode == "kernel"
    rate_scale: float = 1.0
    timeout_s: float = DEFAULT_TIMEOUT_S
    tag: str = ""                               # the emulation's name tag (namespaces gt-<tag>*)
    tls: bool = False                           # cross-DC connections in TLS (transport.tls)
    link_bytes: dict[str, dict[str, int]] = field(default_factory=dict)   # kernel: per DC, at close

    def rank_config(self, asked: WanConfig | None = None) -> WanConfig:
        """The WAN as the ranks run it: `asked` narrowed to this launch's mode, with its addresses."""
        asked = asked or WanConfig()
        if self.mode == "off":
            return WanConfig(mode="off")
        hosts = {dc: self.emulation.address(dc) for dc in self.emulation.dcs} if self.emulation is not None else {}
        return asked.model_copy(update={"mode": self.mode, "rate_scale": self.rate_scale,
                                        "timeout_s": self.timeout_s, "tls": self.tls, "hosts": hosts})

    def env(self, rank: int, master_port: int, inherited: dict[str, str] | None = None) -> dict[str, str]:
        """The rank's namespace environment; NCCL variables already in `inherited` (what the rank
        gets anyway) are not overridden."""
        if self.emulation is None:
            return {}
        return self.emulation.rank_env(self.rank_dc[rank], self.rank_dc[0], master_port, inherited)

    def popen(self, rank: int, argv: Sequence[str], env: dict[str, str], **kw) -> subprocess.Popen:
        if self.emulation is None:
            return subprocess.Popen(list(argv), env=env, **kw)
        self.emulation.check()
        # `ip netns exec` replaces itself with argv: the child keeps our pid as parent (PDEATHSIG holds).
        return subprocess.Popen(["ip", "netns", "exec", self.emulation.netns(self.rank_dc[rank]), *argv],
                                env=env, **kw)

    def close(self) -> None:
        if self.emulation is not None:
            self.link_bytes = self.emulation.link_bytes()    # what crossed the emulated WAN, kept
            self.emulation.stop()
            self.emulation = None

    def __enter__(self) -> WanLaunch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_wan(mode: str, spec, plan, rate_scale: float = 1.0, timeout_s: float = DEFAULT_TIMEOUT_S,
             say: Callable[[str], None] = print, tls: bool = False) -> WanLaunch:
    """Set up the WAN for `plan` (see module docstring); `say` gets one line naming what was chosen."""
    if mode not in MODES:
        raise GeotrainError(f"--wan must be one of {', '.join(MODES)}, got {mode!r}")
    if rate_scale <= 0:
        raise GeotrainError("--wan-rate-scale must be positive")
    rank_dc = [plan.dc_of_rank(r) for r in range(plan.num_ranks)]
    used = plan.worker_dcs()           # a DiLoCo plan: every worker's DCs
    if mode == "off" or len(used) < 2:
        if mode != "off":
            say("WAN: none (every rank is in one datacenter)")
        return WanLaunch("off", rank_dc)
    # Pipelines cross the links between consecutive stages' DCs; a region plan's gradient
    # reduction rings over every pair of its DCs; DiLoCo's outer exchange joins each stage's DCs.
    pairs = [(a, b) for i, a in enumerate(used) for b in used[i + 1:]] if plan.replica_dcs else zip(used, used[1:])
    if plan.outer is not None:
        ws = plan.outer.workers
        pairs = {(w[s], w[s + 1]) for w in ws for s in range(len(w) - 1)} | \
                {(a[s], b[s]) for i, a in enumerate(ws) for b in ws[i + 1:] for s in range(len(a))}
        pairs = sorted((a, b) for a, b in pairs if a != b)
    for a, b in pairs:
        if spec.cluster.link(a, b) is None:
            what = "DP pipelines" if plan.replica_dcs else "stages"
            raise GeotrainError(f"{what} sit in {a} and {b}, but the cluster has no WAN link between them")
    links = "; ".join(f"{ln.between[0]}-{ln.between[1]}: {ln.latency_ms:g} ms one-way, "
                      f"{ln.capacity_gbps * rate_scale:g} Gbit/s, {ln.per_connection_gbps * rate_scale:g} Gbit/s "
                      f"per connection" for ln in spec.cluster.wan_links if set(ln.between) <= set(used))
    fast = max((ln.capacity_gbps * rate_scale for ln in spec.cluster.wan_links), default=0.0)
    why = ""
    if mode in ("auto", "kernel"):
        ok, why = emulation_available()
        if ok:
            cluster = _cluster_of(spec.cluster, used)
            try:
                emu = WanEmulation(cluster, rate_scale=rate_scale, lifetime_s=7 * 86400).start()
            except WanUnavailable as e:
                why = str(e)
            else:
                note = (f" (links above ~{DELAYER_GBPS:g} Gbit/s exceed what the packet delayer carries; "
                        f"consider --wan-rate-scale {DELAYER_GBPS / fast:.2g})") if fast > 2 * DELAYER_GBPS else ""
                say(f"WAN: kernel emulation, one network namespace per datacenter (gt-{emu.tag}-*: "
                    f"{', '.join(f'{dc} {emu.address(dc)}' for dc in used)}), {links}{note}")
                return WanLaunch("kernel", rank_dc, emu, rate_scale, timeout_s, tag=emu.tag, tls=tls)
        if mode == "kernel":
            raise GeotrainError(f"--wan kernel: {why}")
    say(f"WAN: user-space shaper inside the transport{f' (kernel emulation unavailable: {why})' if why else ''}; "
        f"{links} -- only pipeline transfers between datacenters are delayed and rate-limited"
        + (" (this region plan's only cross-DC traffic, its gradient reduction, is not)" if plan.replica_dcs else ""))
    return WanLaunch("shaper", rank_dc, None, rate_scale, timeout_s, tls=tls)


def _cluster_of(cluster, dcs: list[str]):
    """The cluster restricted to the DCs the plan uses (fewer namespaces to build)."""
    keep = set(dcs)
    return cluster.model_copy(update={
        "datacenters": [d for d in cluster.datacenters if d.name in keep],
        "wan_links": [ln for ln in cluster.wan_links if set(ln.between) <= keep]})


def leftover_namespaces(emulation_tag: str) -> list[str]:
    """Namespaces of emulation `emulation_tag` still present (tests: tear-down left nothing)."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [ln.split()[0] for ln in r.stdout.splitlines() if ln.startswith(f"gt-{emulation_tag}")]
