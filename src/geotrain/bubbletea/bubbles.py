"""Predicted idle windows of each rank within one training iteration.

Training repeats every `period` seconds, so a window (offset, length) of iteration 0 recurs
at offset + k * period. A window is any interval where the rank runs no training compute
(forward, backward, optimizer): waiting on a transfer or on the DP reduction leaves the GPU's
compute units idle, and that is exactly what prefill can use.
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.trace.schema import TRAINING_COMPUTE_KINDS, Trace


@dataclass(frozen=True)
class Window:
    offset: float   # seconds from the iteration start
    length: float

    @property
    def end(self) -> float:
        return self.offset + self.length


def bubble_windows(trace: Trace, iteration: int = 0, period: float | None = None,
                   min_length: float = 0.0) -> tuple[dict[int, list[Window]], float]:
    """Idle windows per rank of one iteration, and the iteration period.

    The iteration spans [t0, t0 + period) where t0 is the earliest compute start of that
    iteration; `period` defaults to the span of the iteration's events (one-iteration traces)."""
    busy: dict[int, list[tuple[float, float]]] = {r: [] for r in range(trace.num_ranks)}
    t0, t1 = float("inf"), float("-inf")
    for e in trace.events:
        if e.iteration != iteration:
            continue
        t0, t1 = min(t0, e.start), max(t1, e.end)
        if e.kind in TRAINING_COMPUTE_KINDS:
            busy.setdefault(e.rank, []).append((e.start, e.end))
    if t0 == float("inf"):
        return {}, 0.0
    period = (t1 - t0) if period is None else period
    out: dict[int, list[Window]] = {}
    for rank, intervals in busy.items():
        intervals.sort()
        windows, cursor = [], 0.0
        for s, e in intervals:
            s, e = s - t0, e - t0
            if s - cursor > min_length:
                windows.append(Window(cursor, s - cursor))
            cursor = max(cursor, e)
        if period - cursor > min_length:
            windows.append(Window(cursor, period - cursor))
        out[rank] = windows
    return out, period


def idle_fraction(windows: dict[int, list[Window]], period: float) -> float:
    if not windows or period <= 0:
        return 0.0
    return sum(w.length for ws in windows.values() for w in ws) / (period * len(windows))
