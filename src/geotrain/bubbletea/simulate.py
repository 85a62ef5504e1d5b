"""BubbleTea in simulation: a request stream placed into a simulated plan's bubbles.

Training is simulated first and never changed: prefill only goes where the trace says a
rank is idle, so every training action keeps its start time by construction -- and
`check_no_overlap` verifies it on the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from geotrain.bubbletea.bubbles import Window, bubble_windows
from geotrain.bubbletea.prefill_cost import PrefillCost
from geotrain.bubbletea.scheduler import BubbleScheduler, Placement, Request
from geotrain.trace.schema import TRAINING_COMPUTE_KINDS, Event, Trace


@dataclass
class BubbleTeaResult:
    period: float
    horizon: float
    requests: int
    served: int
    refused: int
    utilization_without: float
    utilization_with: float
    ttft_p50: float
    ttft_p99: float
    prefill_tokens_per_s: float
    placements: list[Placement] = field(default_factory=list)
    windows: dict[int, list[Window]] = field(default_factory=dict)

    def summary_rows(self) -> list[tuple[str, str]]:
        return [
            ("GPU utilization without BubbleTea", f"{self.utilization_without:.1%}"),
            ("GPU utilization with BubbleTea", f"{self.utilization_with:.1%}"),
            ("requests served / refused", f"{self.served} / {self.refused}"),
            ("TTFT p50 / p99", f"{self.ttft_p50 * 1e3:.0f} ms / {self.ttft_p99 * 1e3:.0f} ms"),
            ("prefill tokens/s", f"{self.prefill_tokens_per_s:,.0f}"),
        ]


def run_bubbletea(trace: Trace, requests: list[Request], cost: PrefillCost, *, margin: float = 0.0,
                  min_chunk: int = 16, max_wait: float = float("inf"), period: float | None = None,
                  horizon: float | None = None) -> BubbleTeaResult:
    windows, period = bubble_windows(trace, period=period)
    if horizon is None:
        horizon = max((r.arrival for r in requests), default=0.0) + period
    busy = period - sum(w.length for ws in windows.values() for w in ws) / max(1, len(windows))
    util_without = busy / period if period > 0 else 0.0
    sched = BubbleScheduler(windows, period, cost, margin=margin, min_chunk=min_chunk, max_wait=max_wait)
    placements: list[Placement] = []
    refused = 0
    for req in requests:
        p = sched.place(req)
        if p is None:
            refused += 1
        else:
            placements.append(p)
    # Utilization over [0, horizon): training busy time + prefill inside the horizon.
    ranks = max(1, len(windows))
    prefill_in = sum(max(0.0, min(c.end, horizon) - c.start) for p in placements for c in p.chunks
                     if c.start < horizon)
    util_with = util_without + prefill_in / (ranks * horizon) if horizon > 0 else util_without
    ttfts = np.array([p.ttft for p in placements]) if placements else np.array([0.0])
    tokens = sum(p.request.prompt_len for p in placements if p.finish <= horizon)
    return BubbleTeaResult(
        period=period, horizon=horizon, requests=len(requests), served=len(placements), refused=refused,
        utilization_without=util_without, utilization_with=min(1.0, util_with),
        ttft_p50=float(np.percentile(ttfts, 50)), ttft_p99=float(np.percentile(ttfts, 99)),
        prefill_tokens_per_s=tokens / horizon if horizon > 0 else 0.0,
        placements=placements, windows=windows,
    )


def prefill_events(result: BubbleTeaResult, iteration_start: float = 0.0,
                   until: float | None = None) -> list[Event]:
    """Prefill chunks as trace events (kind "prefill"), e.g. to draw them on the timeline."""
    out = []
    for p in result.placements:
        for c in p.chunks:
            if until is not None and c.start >= until:
                continue
            out.append(Event(rank=c.rank, kind="prefill", start=iteration_start + c.start,
                             end=iteration_start + c.end, mb=p.request.id, bytes=c.tokens))
    return out


def check_no_overlap(trace: Trace, result: BubbleTeaResult) -> None:
    """Raise if any prefill chunk overlaps a training compute action of the same rank, with the
    training timeline repeated every period."""
    t0 = min((e.start for e in trace.events if e.iteration == 0), default=0.0)
    busy: dict[int, list[tuple[float, float]]] = {}
    for e in trace.events:
        if e.iteration == 0 and e.kind in TRAINING_COMPUTE_KINDS:
            busy.setdefault(e.rank, []).append((e.start - t0, e.end - t0))
    T = result.period
    for p in result.placements:
        for c in p.chunks:
            k = int(c.start // T)
            for base in (k * T, (k + 1) * T):
                for s, e in busy.get(c.rank, []):
                    if c.start < base + e - 1e-12 and base + s < c.end - 1e-12:
                        raise AssertionError(f"prefill of request {p.request.id} on rank {c.rank} "
                                             f"[{c.start:.6f}, {c.end:.6f}) overlaps training [{base + s:.6f}, "
                                             f"{base + e:.6f})")
