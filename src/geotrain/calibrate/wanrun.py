"""Run a plan for real the way `geotrain train` does, and measure how busy the machine was meanwhile.

The run goes through the runtime's own launcher and WAN path (`runtime.launch.run_with_wan`): one
process per rank, cross-DC pairs over `StripedTransport` with the plan's connections, temporal
turns and pipeline offsets, intra-DC pairs over gloo. `mode` is the runtime's `--wan`: "shaper"
(default here: delay and rates emulated inside the transport, no packet delayer competing for the
cores) or "kernel" (network namespaces and the packet delayer). The only thing added is a sampling
thread that reads /proc while the ranks run: the machine's load (cpuload.py) and each rank's CPU
and run-queue time (schedstat) -- the calibrated simulation needs how much CPU the ranks got on
this shared machine, which the launcher does not record.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from geotrain.calibrate.cpuload import CpuSampler, cores
from geotrain.runtime.launch import run_with_wan
from geotrain.runtime.train_config import RunCase, TrainConfig, WanConfig

DEFAULT_MODE = "shaper"


def _children() -> list[int]:
    """Pids of this process's children (the launcher's rank processes)."""
    pids: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/children") as f:
                pids += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return pids


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return int(env[b"RANK"])
    except (OSError, KeyError, ValueError):
        return None


def _schedstat(pid: int) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting for one) of the process's main thread -- where a rank
    computes (one CPU thread per rank; autograd runs in the calling thread on CPU)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            run, wait, _ = f.read().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return None


class RunSampling:
    """A thread sampling, every `period_s` until stopped: the machine's load beside our children
    (CpuSampler) and, per rank, its main thread's CPU and run-queue time together with how many
    steps rank 0 has logged -- so the CPU share each rank got while it trained (not while it
    started up) can be read afterwards (`rank_slowdown`)."""

    def __init__(self, losses: Path | None, period_s: float = 0.05):
        self.sampler = CpuSampler()
        self.losses = losses
        self.period_s = period_s
        self.ranks: dict[int, int] = {}                 # pid -> rank
        self.samples: list[tuple[int, dict[int, tuple[int, int]]]] = []   # (steps logged, {rank: schedstat})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def _steps(self) -> int:
        if self.losses is None:      # load only (geotrain train): no per-step window wanted
            return 0
        try:
            return self.losses.read_bytes().count(b"\n")
        except OSError:
            return 0

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            pids = _children()
            if not pids:
                continue
            self.sampler.sample(pids)
            if self.losses is None:
                continue
            stats = {}
            for pid in pids:
                if pid not in self.ranks:
                    r = _rank_of(pid)
                    if r is None:
                        continue
                    self.ranks[pid] = r
                st = _schedstat(pid)
                if st is not None:
                    stats[self.ranks[pid]] = st
            self.samples.append((self._steps(), stats))

    def rank_slowdown(self, warmup: int) -> dict[int, float]:
        """Per rank: (CPU time + run-queue wait) / CPU time of its main thread between the end of
        step `warmup` and the last sample before the run's end -- how much slower than on a core of
        its own it ran, from sharing cores with the other ranks and with everything else."""
        window = [st for n, st in self.samples if n >= max(1, warmup)]
        out = {}
        for r in sorted({r for st in window for r in st}):
            seen = [st[r] for st in window if r in st]       # a rank that exited drops out of later samples
            (run0, wait0), (run1, wait1) = seen[0], seen[-1]
            if run1 > run0:
                out[r] = 1.0 + (wait1 - wait0) / (run1 - run0)
        return out

    def machine_load(self) -> dict:
        """What else the machine ran while our ranks did (CpuSampler), as RUN_DIR/machine_load.json
        records it for the report: other runnable threads, other sessions with one (autogroup; None
        without), CPU the hypervisor stole, in cores, and the cores here."""
        s = self.sampler
        return {"background_runnable": s.background_runnable(), "background_sessions": s.background_sessions(),
                "steal_cores": s.steal_cores(), "cores": cores(), "samples": len(s.runnable)}

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_plan(spec, plan, out: Path, steps: int, mode: str = DEFAULT_MODE, warmup: int = 2,
             timeout_s: float = 300.0) -> tuple[Path, dict]:
    """Train `plan` for `steps` steps into `out` with the runtime's launcher over WAN `mode`.
    Returns (out/measured_trace.jsonl, conditions): conditions has "background_runnable" (other
    threads ready to run meanwhile, on average), "background_cores" (CPU other work got),
    "steal_cores" (CPU the hypervisor took, in cores), "background_sessions" (other sessions with a
    runnable thread: the autogroup scheduler's competitors; None without autogroup),
    "rank_slowdown" ({rank: measured CPU-sharing slow-down after `warmup` steps}, see RunSampling),
    "mode" (the WAN that ran) and "wall_s"."""
    out = Path(out)
    cfg = TrainConfig(out=str(out), steps=steps, progress=False, data="synthetic", checkpoint_every=0,
                      wan=WanConfig(mode=mode))
    (out / "losses.jsonl").unlink(missing_ok=True)
    t0 = time.time()
    with RunSampling(out / "losses.jsonl") as sampling:
        wan = run_with_wan([RunCase(spec, plan, cfg)], out, say=lambda line: None, timeout_s=timeout_s,
                           rank0_stdout=False)
    sampler = sampling.sampler
    return out / "measured_trace.jsonl", {"background_runnable": sampler.background_runnable(),
                                          "background_cores": sampler.background_cores(),
                                          "steal_cores": sampler.steal_cores(),
                                          "background_sessions": sampler.background_sessions(),
                                          "rank_slowdown": sampling.rank_slowdown(warmup), "mode": wan.mode,
                                          "wall_s": time.time() - t0}
