"""Comparisons a report shows: one plan under every schedule kind, and a predicted trace
against a measured one.

Schedule comparison asks the simulator, never a formula: each kind in
`geotrain.schedule.builders.BUILDERS` is simulated on the same layout. A kind whose builder (or
the layout) rejects the shape is listed with the reason rather than silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from geotrain.plan.plan import Plan, StagePlan
from geotrain.trace.metrics import Metrics, compute_metrics
from geotrain.trace.schema import Trace


class CompareRow(NamedTuple):
    """One line of a predicted-vs-measured table. rel_error = (predicted - measured) / measured
    (nan when the measured value is 0)."""

    metric: str
    predicted: float
    measured: float
    rel_error: float
    unit: str


def format_value(v: float, unit: str) -> str:
    """A CompareRow value in human units ("s", "B", "fraction" or a rate unit such as "tok/s")."""
    from geotrain.console import human_bytes, human_rate, human_seconds

    if v != v:  # nan: the trace does not record this quantity
        return "not recorded"
    if unit == "s":
        return human_seconds(v)
    if unit == "B":
        return human_bytes(v)
    if unit == "fraction":
        return f"{100 * v:.1f}%"
    return human_rate(v, unit)


def format_rel(x: float) -> str:
    return "-" if x != x else f"{100 * x:+.1f}%"


def _rel(p: float, m: float) -> float:
    return (p - m) / m if m else float("nan")


def tokens_of(trace: Trace) -> int:
    """Tokens per iteration as recorded in the trace's meta (0 if it does not say)."""
    v = trace.meta.get("tokens_per_iteration", 0) if isinstance(trace.meta, dict) else 0
    return int(v or 0)


def compare_metrics(pm: Metrics, mm: Metrics, num_ranks: tuple[int, int]) -> list[CompareRow]:
    rows = [CompareRow("iteration time", pm.iteration_time, mm.iteration_time,
                       _rel(pm.iteration_time, mm.iteration_time), "s")]
    if pm.tokens_per_s > 0 and mm.tokens_per_s > 0 and pm.tokens_per_s != float("inf"):
        rows.append(CompareRow("tokens/s", pm.tokens_per_s, mm.tokens_per_s,
                               _rel(pm.tokens_per_s, mm.tokens_per_s), "tok/s"))
    rows.append(CompareRow("mean utilization", pm.mean_utilization, mm.mean_utilization,
                           _rel(pm.mean_utilization, mm.mean_utilization), "fraction"))

    def bubble_per_gpu(m: Metrics, n: int) -> float:
        return sum(b - a for _, a, b in m.bubbles) / max(1, n) / max(1, m.iterations)

    pb, mb = bubble_per_gpu(pm, num_ranks[0]), bubble_per_gpu(mm, num_ranks[1])
    rows.append(CompareRow("bubble time per GPU per iteration", pb, mb, _rel(pb, mb), "s"))
    rows.append(CompareRow("bubble fraction", pm.bubble_fraction, mm.bubble_fraction,
                           _rel(pm.bubble_fraction, mm.bubble_fraction), "fraction"))
    if pm.wan_bytes or mm.wan_bytes:
        # The runtime records no transfer events, so a measured 0 next to a predicted >0 means
        # "not recorded", not "nothing crossed the WAN" (a plan with WAN transfers always sends).
        measured = mm.wan_bytes if mm.wan_bytes or not pm.wan_bytes else float("nan")
        rows.append(CompareRow("WAN bytes per iteration", pm.wan_bytes, measured,
                               _rel(pm.wan_bytes, measured), "B"))
    return rows


def compare_traces(predicted: Trace, measured: Trace, tokens_per_iteration: int | None = None) -> list[CompareRow]:
    """Iteration time, tokens/s (when tokens are known), utilization, bubble time and WAN bytes
    of both traces and their relative error; both traces go through the same `compute_metrics`."""
    from geotrain.report.layout import num_ranks

    tok = tokens_per_iteration if tokens_per_iteration is not None else (tokens_of(predicted) or tokens_of(measured))
    pm = compute_metrics(predicted, tok)
    mm = compute_metrics(measured, tok)
    return compare_metrics(pm, mm, (num_ranks(predicted), num_ranks(measured)))


# -- schedule kinds -------------------------------------------------------------------------

def _even_chunks(plan: Plan, num_units: int, v: int) -> tuple[StagePlan, ...]:
    """The plan's stages (same DCs) with the model cut evenly into pp * v virtual stages."""
    from geotrain.plan.manual import split_even

    ranges = split_even(num_units, plan.pp * v)
    return tuple(StagePlan(dc=st.dc, chunks=tuple(ranges[c * plan.pp + s] for c in range(v)))
                 for s, st in enumerate(plan.stages))


def wan_warmup_for(spec: Any, plan: Plan) -> tuple[int, ...]:
    """Extra warm-up forwards for a wan-1f1b variant of `plan`: enough to cover each WAN round
    trip after a stage (`wan_extra_warmup`), capped by how many micro-batches' activations fit
    in the stage's GPU memory under the cost model."""
    from geotrain.cost import CostModel
    from geotrain.schedule.wan import wan_extra_warmup

    cluster = spec.cluster
    cost = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing,
                     optimizer=spec.job.optimizer)
    fwd, bwd, cap = [], [], []
    for st in plan.stages:
        gpu = cluster.gpu(cluster.dc(st.dc).gpu_type)
        t = cost.stage_times(st.units, gpu, plan.micro_batch, plan.tp)
        fwd.append(t.forward)
        bwd.append(t.backward)
        k = plan.pp
        while k < plan.num_microbatches and cost.stage_memory(
                st.units, gpu, plan.micro_batch, k + 1, plan.sharding, plan.dp, plan.tp).total <= gpu.memory_bytes:
            k += 1
        cap.append(k)
    lat = []
    for a, b in zip(plan.stages, plan.stages[1:]):
        link = cluster.link(a.dc, b.dc) if a.dc != b.dc else None
        lat.append(link.latency_ms / 1000 if link else 0.0)
    return tuple(wan_extra_warmup(plan.pp, fwd, bwd, lat, cap))


def schedule_variant(plan: Plan, kind: str, num_units: int, spec: Any = None) -> tuple[Plan, str]:
    """The plan re-targeted to schedule `kind`, plus a note on what had to change.
    Interleaved needs two or more model chunks per stage; the others need exactly one;
    wan-1f1b without its own extra warm-up gets one computed from the spec (when given)."""
    if kind == plan.schedule:
        return plan, ""
    if kind == "wan-1f1b" and not plan.extra_warmup and spec is not None:
        base, note = schedule_variant(plan, "1f1b", num_units)
        extra = wan_warmup_for(spec, base)
        note = "; ".join(x for x in (note, f"extra warm-up {list(extra)}") if x)
        return base.with_(schedule=kind, extra_warmup=extra), note
    if kind == "interleaved":
        if plan.virtual_per_stage >= 2:
            return plan.with_(schedule=kind), ""
        return plan.with_(schedule=kind, stages=_even_chunks(plan, num_units, 2)), "2 chunks per stage, even split"
    if plan.virtual_per_stage > 1:
        return plan.with_(schedule=kind, stages=_even_chunks(plan, num_units, 1)), "one chunk per stage, even split"
    return plan.with_(schedule=kind), ""


@dataclass
class ScheduleRow:
    kind: str
    iteration_time: float | None
    tokens_per_s: float | None
    mean_utilization: float | None
    bubble_fraction: float | None
    peak_memory: float | None
    note: str

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def row_from_metrics(kind: str, m: Metrics, note: str = "") -> ScheduleRow:
    return ScheduleRow(kind, m.iteration_time, m.tokens_per_s, m.mean_utilization, m.bubble_fraction,
                       max(m.peak_memory.values()) if m.peak_memory else None, note)


def compare_schedules(spec: Any, plan: Plan, iterations: int = 1, known: dict[str, Metrics] | None = None,
                      progress: bool | None = None) -> list[ScheduleRow]:
    """Simulate `plan` under every registered schedule kind. `known` holds metrics already
    computed (the main run's), which are reused instead of simulated again."""
    from geotrain.console import progress as bar
    from geotrain.errors import GeotrainError
    from geotrain.schedule.builders import BUILDERS
    from geotrain.sim import simulate

    known = known or {}
    rows: list[ScheduleRow] = []
    kinds = list(BUILDERS)
    for kind in bar(kinds, total=len(kinds), desc="schedules", enable=progress):
        if kind in known and kind == plan.schedule:
            rows.append(row_from_metrics(kind, known[kind], "the plan's schedule"))
            continue
        try:
            variant, note = schedule_variant(plan, kind, spec.model.num_units, spec)
            res = simulate(spec, variant, iterations=iterations)
        except (ValueError, GeotrainError) as e:
            rows.append(ScheduleRow(kind, None, None, None, None, None, f"not applicable: {e}"))
            continue
        rows.append(row_from_metrics(kind, res.metrics, note))
    return rows
