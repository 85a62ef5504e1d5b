"""Single-process timings for the profile, taken the way `geotrain.runtime` executes the model.

Each unit runs as a `UnitStack` of that unit, fp32 weights under the precision's autocast, float32
boundary tensors, the last unit's loss through the runtime's own `lm_loss` -- so the numbers are
the runtime's, not a kernel benchmark's. `measure_units` is the cost model's profile table (per
unit kind and micro-batch: forward and backward seconds) from these same timings, on CPU or GPU.
Robust statistics (a low percentile) because the machine is shared.

Every timer runs on the rank's device (`runtime.rank_model.rank_device`: its GPU under CUDA, else
the CPU) unless told otherwise, and reads that device's clock (`device_timer`): on CUDA, events
recorded on the device's stream and read after it finished -- the GPU's time for the work, not
the host's time to queue it (kernels launch asynchronously); on the CPU, the host's clock.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch

from geotrain.costs.units import BLOCK, EMBEDDING, HEAD
from geotrain.models.llama import build_units
from geotrain.runtime.interpreter import lm_loss
from geotrain.runtime.parallelize import autocast_context
from geotrain.runtime.rank_model import rank_device
from geotrain.runtime.trainer import make_optimizer
from geotrain.torch_compat import stage_backward_input, stage_backward_weight


class HostTimer:
    """The CPU's clock: work on the CPU is done when the call returns."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        return b - a


class CudaEventTimer:
    """A CUDA device's clock: an event recorded on its current stream per mark; `seconds` waits for
    the later event, then reads the GPU time between the two."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self):
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def seconds(self, a, b) -> float:
        b.synchronize()
        return a.elapsed_time(b) / 1e3


def timing_device(device: str | torch.device | None = None) -> torch.device:
    """The device to time on: the one given, else the rank's (as the runtime computes there)."""
    return torch.device(device) if device is not None else rank_device()


def device_timer(device: torch.device) -> HostTimer | CudaEventTimer:
    return CudaEventTimer(device) if device.type == "cuda" else HostTimer(device)


def _median_times(fn, repeats: int, warmup: int = 2) -> tuple[float, float]:
    """The 10th percentile of `repeats` timed runs after `warmup`: the machine is shared, and a run
    that another process preempted is slower for a reason the profile must not bake in (the
    calibrated simulation models other work separately, from the measured background load)."""
    fwd, bwd = [], []
    for i in range(repeats + warmup):
        a, b = fn()
        if i >= warmup:
            fwd.append(a)
            bwd.append(b)
    return low_percentile(fwd), low_percentile(bwd)


def low_percentile(xs: list[float]) -> float:
    """The 10th percentile (lower quartile's stricter cousin: robust to most runs being preempted)."""
    xs = sorted(xs)
    return xs[(len(xs) - 1) // 10]


def time_unit(spec, index: int, micro_batch: int, precision: str, repeats: int = 10,
              device: str | None = None) -> tuple[float, float]:
    """(forward_s, backward_s) of model unit `index` at `micro_batch`, executed as the runtime does."""
    return _median_times(unit_runner(spec, index, micro_batch, precision, device), repeats)


def measure_units(spec, micro_batches: Iterable[int] = (1,), precision: str = "fp32", repeats: int = 10,
                  device: str | None = None) -> dict[str, Any]:
    """The cost model's profile table (geotrain.costs.unit_times): {"embedding"|"block"|"head":
    {str(micro_batch): [forward_s, backward_s]}}, one unit of each kind built alone -- cheap even
    for large shapes (a 70B block is ~1.7 GB in bf16), so a big model's table can be taken on one GPU."""
    return {kind: {str(mb): list(time_unit(spec, index, mb, precision, repeats, device)) for mb in micro_batches}
            for kind, index in ((EMBEDDING, 0), (BLOCK, 1), (HEAD, spec.layers + 1))}


def unit_runner(spec, index: int, micro_batch: int, precision: str, device: str | None = None):
    """A function that runs unit `index` forward and backward once and returns (forward_s, backward_s)."""
    m = spec
    dev = timing_device(device)
    clock = device_timer(dev)
    stack = build_units(m, index, index + 1).to(dev)
    autocast = autocast_context(precision, dev)
    g = torch.Generator().manual_seed(index)
    tokens = torch.randint(0, m.vocab, (micro_batch, m.seq_len), generator=g).to(dev)
    x0 = torch.randn(micro_batch, m.seq_len, m.hidden, generator=g).to(dev)
    grad = torch.randn(micro_batch, m.seq_len, m.hidden, generator=g).to(dev)

    def once() -> tuple[float, float]:
        stack.zero_grad(set_to_none=True)
        inp = tokens if index == 0 else x0.detach().clone().requires_grad_(True)
        t0 = clock.mark()
        with autocast():
            out = stack(inp)
        if stack.has_head:
            out = lm_loss(out, tokens)
        t1 = clock.mark()
        torch.autograd.backward(out, None if stack.has_head else grad)
        t2 = clock.mark()
        return clock.seconds(t0, t1), clock.seconds(t1, t2)

    return once


def time_split_backward(spec, micro_batch: int, precision: str, repeats: int = 10,
                        device: str | None = None) -> dict[str, float]:
    """The zero-bubble split of a backward as the runtime runs it (torch.distributed.pipelining's
    stage_backward_input, then stage_backward_weight) on units 1..L+1 (blocks and head), relative to
    one plain backward of the same units: {"input": B_input / B, "weight": W / B}. The split costs
    more than the whole (two autograd passes), and not half and half."""
    m = spec
    dev = timing_device(device)
    clock = device_timer(dev)
    stack = build_units(m, 1, m.num_units).to(dev)
    autocast = autocast_context(precision, dev)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.vocab, (micro_batch, m.seq_len), generator=g).to(dev)
    x0 = torch.randn(micro_batch, m.seq_len, m.hidden, generator=g).to(dev)

    def once(split: bool) -> tuple[float, float]:
        stack.zero_grad(set_to_none=True)
        inp = x0.detach().clone().requires_grad_(True)
        with autocast():
            out = lm_loss(stack(inp), tokens)
        t0 = clock.mark()
        if not split:
            torch.autograd.backward(out)
            return clock.seconds(t0, clock.mark()), 0.0
        _, groups = stage_backward_input([out], None, [inp], stack.parameters())
        t1 = clock.mark()
        stage_backward_weight(stack.parameters(), groups)
        return clock.seconds(t0, t1), clock.seconds(t1, clock.mark())

    whole, parts = [], []
    for i in range(repeats + 2):            # interleaved: a burst of other work hits both alike
        w, p = once(False)[0], once(True)
        if i >= 2:
            whole.append(w)
            parts.append(p)
    # Per pair ratios, then the median: robust to a pair that another process preempted.
    ins = sorted(a / w for (a, _), w in zip(parts, whole))
    ws = sorted(b / w for (_, b), w in zip(parts, whole))
    return {"input": ins[len(ins) // 2], "weight": ws[len(ws) // 2]}


def time_optimizer(spec, units: range, job, repeats: int = 8, device: str | None = None) -> tuple[int, float]:
    """(parameters, seconds) of one optimizer step (+ zero_grad) over `units`, as the runtime steps it."""
    dev = timing_device(device)
    clock = device_timer(dev)
    stack = build_units(spec, units.start, units.stop).to(dev)
    params = list(stack.parameters())
    opt = make_optimizer(params, job)
    times = []
    for i in range(repeats + 2):
        for p in params:
            p.grad = torch.ones_like(p)
        t0 = clock.mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = clock.mark()
        if i >= 2:
            times.append(clock.seconds(t0, t1))
    return sum(p.numel() for p in params), low_percentile(times)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope), both clamped at >= 0 (a cost never falls with size)."""
    n = len(xs)
    if n == 1 or max(xs) == min(xs):
        return max(0.0, statistics.mean(ys)), 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


def measure_startup(repeats: int = 2) -> float:
    """Seconds for one rank's process to start and import what the runtime worker imports."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import geotrain.runtime.worker"], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        times.append(time.perf_counter() - t0)
    return min(times)
