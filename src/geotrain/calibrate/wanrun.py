"""Run a plan for real the way `geotrain train` does, and measure how busy the machine was meanwhile.

The run goes through the runtime's own launcher and WAN path (`runtime.launch.run_with_wan`): one
process per rank, cross-DC pairs over `StripedTransport` with the plan's connections, temporal
turns and pipeline offsets, intra-DC pairs over gloo. `mode` is the runtime's `--wan`: "shaper"
(default here: delay and rates emulated inside the transport, no packet delayer competing for the
cores) or "kernel" (network namespaces and the packet delayer). The only thing added is a
`CpuSampler` thread that reads /proc while the ranks run (cpuload.py): the calibrated simulation
needs the other work on the machine, which the launcher does not record.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

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


class _Sampling:
    """A thread calling CpuSampler.sample on our children every `period_s` until stopped."""

    def __init__(self, period_s: float = 0.05):
        from geotrain.calibrate.cpuload import CpuSampler

        self.sampler = CpuSampler()
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            pids = _children()
            if pids:
                self.sampler.sample(pids)

    def __enter__(self):
        self._thread.start()
        return self.sampler

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_plan(spec, plan, out: Path, steps: int, mode: str = DEFAULT_MODE,
             timeout_s: float = 300.0) -> tuple[Path, dict]:
    """Train `plan` for `steps` steps into `out` with the runtime's launcher over WAN `mode`.
    Returns (out/measured_trace.jsonl, conditions): conditions has "background_runnable" (other
    threads ready to run meanwhile, on average), "background_cores" (CPU other work got), "mode"
    (the WAN that ran) and "wall_s"."""
    from geotrain.runtime.launch import run_with_wan
    from geotrain.runtime.trainer import RunConfig

    out = Path(out)
    cfg = RunConfig(spec=str(spec.path), out=str(out), plan=plan.to_dict(), steps=steps, progress=False,
                    predict=False, data="synthetic", checkpoint_every=0)
    t0 = time.time()
    with _Sampling() as sampler:
        wan = run_with_wan([cfg], spec, plan, out, mode=mode, say=lambda line: None, timeout_s=timeout_s,
                           rank0_stdout=False)
    return out / "measured_trace.jsonl", {"background_runnable": sampler.background_runnable(),
                                          "background_cores": sampler.background_cores(), "mode": wan.mode,
                                          "wall_s": time.time() - t0}
