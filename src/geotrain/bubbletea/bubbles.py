"""Predicted idle windows of each rank within one training iteration.

Training repeats every `period` seconds, so a window (offset, length) of iteration 0 recurs
at offset + k * period. A window is any interval where the rank neither computes for training
(forward, backward, optimizer) nor takes part in the DP reduction: waiting on a pipeline
transfer leaves the GPU's compute units idle, and that is what prefill uses. The reduction is
left alone: its collective kernels occupy the GPU and it gates the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.trace.schema import TRAINING_COMPUTE_KINDS, Trace

NOT_FILLABLE = TRAINING_COMPUTE_KINDS | {"allreduce"}


@dataclass(frozen=True)
class Window:
    offset: float   # seconds from the iteration start
    length: float

    @property
    def end(self) -> float:
        return self.offset + self.length


def bubble_windows(trace: Trace, iteration: int = 0, period: float | None = None,
                   min_length: float = 0.0, fill_dp_reduction: bool = False) -> tuple[dict[int, list[Window]], float]:
    """Idle windows per rank of one iteration, and the iteration period.

    The iteration spans [t0, t0 + period) where t0 is the earliest compute start of that
    iteration; `period` defaults to the span of the iteration's events (one-iteration traces).
    Works on the trace's columns, so a simulated trace of thousands of GPUs is never expanded
    into Event objects. fill_dp_reduction: also offer the DP reduction's time (prefill then
    overlaps the collective, as compute overlaps communication in FSDP; NCCL's kernels take
    only a few of the GPU's SMs) -- an option, since the two then share memory bandwidth."""
    # lazy: numpy only when called (importers that never call it stay free of it)
    import numpy as np

    from geotrain.trace.metrics import trace_columns

    cols = trace_columns(trace)
    sel = cols.iteration == iteration
    if not sel.any():
        return {}, 0.0
    t0, t1 = float(cols.start[sel].min()), float(cols.end[sel].max())
    period = (t1 - t0) if period is None else period
    comp = sel & cols.kind_mask(TRAINING_COMPUTE_KINDS if fill_dp_reduction else NOT_FILLABLE)
    ranks, starts, ends = cols.rank[comp], cols.start[comp] - t0, cols.end[comp] - t0
    order = np.lexsort((starts, ranks))
    ranks, starts, ends = ranks[order].tolist(), starts[order].tolist(), ends[order].tolist()
    out: dict[int, list[Window]] = {r: [] for r in range(trace.num_ranks)}
    cursor: dict[int, float] = {}
    for r, s, e in zip(ranks, starts, ends):
        c = cursor.get(r, 0.0)
        if s - c > min_length:
            out[r].append(Window(c, s - c))
        cursor[r] = max(c, e)
    for r in out:
        c = cursor.get(r, 0.0)
        if period - c > min_length:
            out[r].append(Window(c, period - c))
    return out, period

