"""Numbers a report shows, derived from Metrics + the plan: per-stage busy/bubble/memory, the
bubble list summary, and the metrics.json document (so `geotrain report` can rebuild a page
without the spec or the simulator)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from geotrain.layout.plan import Plan
from geotrain.trace.metrics import Metrics
from geotrain.trace.rank_roles import RankInfo


@dataclass
class StageRow:
    stage: int
    dc: str
    ranks: int
    busy_fraction: float          # mean over the stage's ranks
    bubble_s: float               # mean bubble time per GPU per iteration
    peak_memory: float | None     # bytes, max over the stage's ranks (cost model)
    gpu_memory: float | None      # bytes per GPU of the stage's DC


def stage_rows(metrics: Metrics, layout: list[RankInfo], gpu_memory: dict[str, float] | None = None) -> list[StageRow]:
    by_stage: dict[int, list[RankInfo]] = defaultdict(list)
    for info in layout:
        by_stage[info.stage].append(info)
    bubble_per_rank: dict[int, float] = defaultdict(float)
    for r, a, b in metrics.bubbles:
        bubble_per_rank[r] += b - a
    its = max(1, metrics.iterations)
    rows = []
    for s in sorted(by_stage):
        infos = by_stage[s]
        ranks = [i.rank for i in infos]
        mem = [metrics.peak_memory[r] for r in ranks if r in metrics.peak_memory]
        dc = infos[0].dc                 # a region plan's stage spans DCs of alike hardware: name them all
        rows.append(StageRow(
            stage=s, dc="+".join(dict.fromkeys(i.dc for i in infos)), ranks=len(ranks),
            busy_fraction=sum(metrics.busy_fraction.get(r, 0.0) for r in ranks) / len(ranks),
            bubble_s=sum(bubble_per_rank[r] for r in ranks) / len(ranks) / its,
            peak_memory=max(mem) if mem else None,
            gpu_memory=(gpu_memory or {}).get(dc),
        ))
    return rows


@dataclass
class BubbleSummary:
    count: int
    total_s: float                # GPU-seconds over the whole trace
    per_gpu_iteration_s: float    # mean bubble time per GPU per iteration
    fraction: float               # of all GPU time
    largest: list[tuple[int, float, float]]


def bubble_summary(metrics: Metrics, num_ranks: int, top: int = 10) -> BubbleSummary:
    total = sum(b - a for _, a, b in metrics.bubbles)
    largest = sorted(metrics.bubbles, key=lambda x: x[1] - x[2])[:top]
    return BubbleSummary(
        count=len(metrics.bubbles), total_s=total,
        per_gpu_iteration_s=total / max(1, num_ranks) / max(1, metrics.iterations),
        fraction=metrics.bubble_fraction, largest=largest,
    )


def gpu_memory_per_dc(spec: Any) -> dict[str, float]:
    """Bytes of memory per GPU in each DC of a spec's cluster."""
    c = spec.cluster
    return {dc.name: c.gpu(dc.gpu_type).memory_bytes for dc in c.datacenters}


def metrics_document(metrics: Metrics, layout: list[RankInfo], *, plan: Plan | None = None,
                     tokens_per_iteration: int | None = None, gpu_memory: dict[str, float] | None = None,
                     schedules: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The metrics.json content: scalar metrics, per stage, per link, bubble summary, the
    schedule comparison, and what `geotrain report` needs to recompute (tokens, GPU memory)."""
    bs = bubble_summary(metrics, len(layout))
    doc: dict[str, Any] = {
        "format": "geotrain-metrics/1",
        **metrics.summary(),
        "tokens_per_iteration": tokens_per_iteration,
        "bubble_time_per_gpu_iteration_s": bs.per_gpu_iteration_s,
        "bubble_total_gpu_s": bs.total_s,
        "largest_bubbles": [list(b) for b in bs.largest],
        "stages": [vars(r) for r in stage_rows(metrics, layout, gpu_memory)],
        "busy_fraction": {str(r): f for r, f in metrics.busy_fraction.items()},
        "peak_memory": {str(r): m for r, m in metrics.peak_memory.items()},
        "gpu_memory_per_dc": dict(gpu_memory or {}),
    }
    if plan is not None:
        doc["plan_name"] = plan.name
        doc["schedule"] = plan.schedule
    if schedules is not None:
        doc["schedule_comparison"] = schedules
    return doc
