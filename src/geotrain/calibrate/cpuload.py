"""How much of the machine's CPU other work used while we measured (Linux /proc).

Runs here share 2 cores with whatever else the machine does (other test suites, benchmarks). A
rank's compute is then slower than the profile's, in proportion to how many runnable processes
share the cores. `CpuSampler` measures the background as the number of other threads ready to run
(machine-wide runnable count from /proc/loadavg minus our processes' running threads), sampled
while our processes run. The calibrated simulation (costs.py) turns it into a slow-down with
processor sharing: k of our ranks computing at once beside b runnable others each get
cores / (k + b) of a core, when that is below 1. (It also reports the CPU others actually got:
total busy time from /proc/stat minus our processes' utime+stime.)
"""

from __future__ import annotations

import os
import time

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _steal() -> float:
    """CPU-seconds the hypervisor ran something else while this (virtual) machine wanted its cores,
    since boot, all cores together (8th field of /proc/stat's cpu line; 0 on bare metal)."""
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    return int(parts[7]) / TICK if len(parts) > 7 else 0.0


def _total_busy() -> float:
    """Busy CPU-seconds of the whole machine since boot (all cores; not idle, not iowait)."""
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    vals = [int(x) for x in parts]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    busy = sum(vals[:8]) - idle          # user nice system idle iowait irq softirq steal
    return busy / TICK


def _proc_cpu(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK    # utime, stime (all threads)


def _runnable_system() -> int:
    """Threads runnable right now, machine-wide (4th field of /proc/loadavg, "running/total")."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


def autogroup_enabled() -> bool:
    """Whether the kernel shares the cores between sessions first (CONFIG_SCHED_AUTOGROUP, on here):
    then each session with a runnable thread is one competitor, however many threads it has."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def runnable_sessions(exclude: set[int]) -> set[int]:
    """Sessions (setsid groups) with at least one runnable thread right now, those in `exclude` left
    out: what the autogroup scheduler shares the cores between. One pass over /proc/*/task/*/stat
    (~200 threads here: a few ms, so sampled less often than the cheap counts)."""
    found: set[int] = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "R":
                sid = int(fields[3])
                if sid not in exclude:
                    found.add(sid)
                break                            # one runnable thread makes its session a competitor
    return found


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _runnable_of(pid: int) -> int:
    n = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "R":
                    n += 1
        except OSError:
            continue
    return n


class CpuSampler:
    """Call `sample(pids)` now and then while our processes run; `background_runnable()` and
    `background_cores()` at the end.

    background_runnable: mean number of OTHER threads ready to run (machine-wide runnable count
    minus ours minus the sampler itself) -- under the kernel's fair scheduler each of them takes a
    share of the cores like one of our ranks does, which is what the slow-down model needs.
    background_cores: CPU other work actually got (a consequence of the sharing; for the record).
    steal_cores: CPU the hypervisor gave to other guests while ours wanted it, in cores -- load no
    thread of this machine shows, one suspect for runs minutes apart differing.
    background_sessions: with autogroup scheduling (`autogroup_enabled`), the mean number of OTHER
    sessions with a runnable thread (ours -- each rank's own session, the sampler's -- left out),
    every `session_every`-th sample: the competitors the scheduler really shares the cores with; a
    test suite running eight threads in one session counts once. None without autogroup."""

    def __init__(self, session_every: int = 10):
        self.runnable: list[int] = []
        self.t0 = time.monotonic()
        self.busy0 = _total_busy()
        self.own0 = _proc_cpu(os.getpid()) or 0.0
        self.ours: dict[int, float] = {}
        self.t1, self.busy1, self.own1 = self.t0, self.busy0, self.own0
        self.steal0 = self.steal1 = _steal()
        self.session_every = session_every
        self.sessions: list[int] | None = [] if autogroup_enabled() else None
        self._n = 0

    def sample(self, pids: list[int]) -> None:
        others = _runnable_system() - 1 - sum(_runnable_of(p) for p in pids)
        self.runnable.append(max(0, others))
        if self.sessions is not None and self._n % self.session_every == 0:
            ours = {sid for sid in map(_session_of, [*pids, os.getpid()]) if sid is not None}
            self.sessions.append(len(runnable_sessions(ours)))
        self._n += 1
        for p in pids:
            v = _proc_cpu(p)
            if v is not None:
                self.ours[p] = v
        self.t1, self.busy1, self.own1 = time.monotonic(), _total_busy(), _proc_cpu(os.getpid()) or self.own1
        self.steal1 = _steal()

    def background_runnable(self) -> float:
        return sum(self.runnable) / len(self.runnable) if self.runnable else 0.0

    def background_sessions(self) -> float | None:
        if self.sessions is None:
            return None
        return sum(self.sessions) / len(self.sessions) if self.sessions else 0.0

    def steal_cores(self) -> float:
        dt = self.t1 - self.t0
        return max(0.0, (self.steal1 - self.steal0) / dt) if dt > 0 else 0.0

    def background_cores(self) -> float:
        dt = self.t1 - self.t0
        if dt <= 0:
            return 0.0
        ours = sum(self.ours.values()) + (self.own1 - self.own0)
        return max(0.0, (self.busy1 - self.busy0 - ours) / dt)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
