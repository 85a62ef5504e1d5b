"""Names, state files and tear-down for the emulated WAN (network namespaces, root only).

Everything an emulation creates is named from one short tag (`gt-<tag>` for the router namespace,
`gt-<tag>-<dc>` per datacenter) and written to a state file *before* it is created, so a crashed
run can always be found and removed again: by the next `WanEmulation`, by `geotrain wan down`,
or by the packet delayer itself when its owner process disappears.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_DIRS = (Path("/run/geotrain"), Path("/tmp/geotrain-wan"))
PREFIX = "gt-"
DC_IFNAME = "gt0"          # the DC side of each veth (same name in every DC namespace)
TUN_IFNAME = "gttun"       # the router's TUN device the delayer reads and writes
SUBNET = "10.77"           # DC i (0-based) lives in 10.77.(i+1).0/24: router .1, DC .2


ETC_NETNS = Path("/etc/netns")    # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*


def write_name_files(ns: str, hosts: dict[str, str]) -> None:
    """Give a namespace its own /etc/hosts (DC names) and a resolver that fails at once: without
    them a reverse lookup of a 10.77.x.y address (TCPStore, gloo) waits ~10 s for an unreachable DNS."""
    d = ETC_NETNS / ns
    d.mkdir(parents=True, exist_ok=True)
    lines = ["127.0.0.1 localhost", *(f"{addr} {name}" for name, addr in hosts.items())]
    (d / "hosts").write_text("\n".join(lines) + "\n")
    (d / "resolv.conf").write_text("# geotrain WAN emulation: no DNS inside the emulated datacenters\n"
                                   "options timeout:1 attempts:1\n")


def hostname(dc: str) -> str:
    return re.sub(r"[^a-z0-9-]", "-", dc.lower()).strip("-") or "dc"


def state_dir() -> Path:
    for d in STATE_DIRS:
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise OSError("no writable state directory (" + ", ".join(map(str, STATE_DIRS)) + ")")


def dc_slug(name: str) -> str:
    """A DC name reduced to what a namespace name may hold, short enough to stay readable."""
    slug = re.sub(r"[^a-z0-9_]", "_", name.lower())[:16]
    return slug or "dc"


def router_ns(tag: str) -> str:
    return f"{PREFIX}{tag}"


def dc_ns(tag: str, index: int, name: str) -> str:
    return f"{PREFIX}{tag}-{index}{dc_slug(name)}"


def router_ifname(index: int) -> str:
    return f"gtd{index}"


def dc_address(index: int) -> str:
    return f"{SUBNET}.{index + 1}.2"


def router_address(index: int) -> str:
    return f"{SUBNET}.{index + 1}.1"


def dc_subnet(index: int) -> str:
    return f"{SUBNET}.{index + 1}.0/24"


@dataclass
class WanState:
    """What one emulation created; written before creation, removed after tear-down."""

    tag: str
    router: str
    namespaces: list[str]                      # DC namespaces, in cluster order
    dcs: list[str]                             # DC names, same order
    owner_pid: int | None                      # None for `geotrain wan up` (manual lifetime)
    owner_start: float | None = None           # process start time, guards against pid reuse
    delayer_pid: int | None = None
    created: float = field(default_factory=time.time)
    lifetime_s: float | None = None

    @property
    def path(self) -> Path:
        return state_dir() / f"wan-{self.tag}.json"

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(self.path)

    @classmethod
    def load(cls, path: Path) -> WanState:
        return cls(**json.loads(path.read_text()))

    def all_namespaces(self) -> list[str]:
        return [*self.namespaces, self.router]


def all_states() -> list[WanState]:
    out = []
    for d in STATE_DIRS:
        if d.is_dir():
            for p in sorted(d.glob("wan-*.json")):
                try:
                    out.append(WanState.load(p))
                except (OSError, ValueError, TypeError):
                    continue
    return out


def process_start_time(pid: int) -> float | None:
    """Start time of `pid` in clock ticks since boot (None if it does not exist)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return float(stat.rsplit(")", 1)[1].split()[19])


def owner_alive(st: WanState) -> bool:
    if st.owner_pid is None:
        if st.lifetime_s is not None and time.time() > st.created + st.lifetime_s + 60:
            return False
        return st.delayer_pid is not None and process_start_time(st.delayer_pid) is not None
    start = process_start_time(st.owner_pid)
    return start is not None and (st.owner_start is None or start == st.owner_start)


def existing_namespaces() -> set[str]:
    p = Path("/run/netns")
    return {x.name for x in p.iterdir()} if p.is_dir() else set()


def run_ip(*args: str, ns: str | None = None, check: bool = True, input: str | None = None) -> str:
    """Run `ip` (optionally inside a namespace); a failure raises with the command and its stderr."""
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(argv, capture_output=True, text=True, input=input)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def ns_exec(ns: str, argv: list[str], check: bool = True) -> str:
    r = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"in {ns}: {' '.join(argv)}: {r.stderr.strip()}")
    return r.stdout


def ns_pids(ns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []


def kill_pids(pids: list[int], grace_s: float = 2.0) -> None:
    """SIGTERM the given processes (only ones this emulation started), SIGKILL the stubborn."""
    me = os.getpid()
    pids = [p for p in pids if p != me]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if process_alive(p)]
        if pids:
            time.sleep(0.05)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as gone)."""
    return process_start_time(pid) is not None and not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def teardown(st: WanState, *, kill_delayer: bool = True) -> None:
    """Remove everything `st` names: processes inside its namespaces, the namespaces (which takes
    their veths, routes, rules, qdiscs and the TUN with them) and the state file. Idempotent."""
    present = existing_namespaces()
    pids: list[int] = []
    for ns in st.all_namespaces():
        if ns in present:
            pids += ns_pids(ns)
    if kill_delayer and st.delayer_pid and process_start_time(st.delayer_pid) is not None:
        pids.append(st.delayer_pid)
    kill_pids(sorted(set(pids)))
    for ns in st.all_namespaces():
        if ns in present:
            run_ip("netns", "del", ns, check=False)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    for path in (st.path, st.path.with_suffix(".log")):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def clean_stale(verbose: bool = True) -> list[str]:
    """Tear down every recorded emulation whose owner is gone; returns their tags."""
    cleaned = []
    for st in all_states():
        if not owner_alive(st):
            if verbose:
                print(f"geotrain wan: removing stale emulation {st.tag} (owner pid {st.owner_pid} is gone)",
                      file=sys.stderr)
            teardown(st)
            cleaned.append(st.tag)
    return cleaned
