"""A plan re-targeted to another schedule kind, and the wan-1f1b warm-up a layout needs.

Plan data in, plan data out (with the cost model's stage times and memory): the report's
schedule comparison and the validation cases both start from these, and neither needs the
other to get them.
"""

from __future__ import annotations

from typing import Any

from geotrain.costs import CostModel
from geotrain.layout.plan import Plan, StagePlan
from geotrain.planner.manual import split_even
from geotrain.schedule.wan_warmup import wan_extra_warmup


def _even_chunks(plan: Plan, num_units: int, v: int) -> tuple[StagePlan, ...]:
    """The plan's stages (same DCs) with the model cut evenly into pp * v virtual stages."""
    ranges = split_even(num_units, plan.pp * v)
    return tuple(StagePlan(dc=st.dc, chunks=tuple(ranges[c * plan.pp + s] for c in range(v)))
                 for s, st in enumerate(plan.stages))


def wan_warmup_for(spec: Any, plan: Plan) -> tuple[int, ...]:
    """Extra warm-up forwards for a wan-1f1b variant of `plan`: enough to cover each WAN round
    trip after a stage (`wan_extra_warmup`), capped by how many micro-batches' activations fit
    in the stage's GPU memory under the cost model."""
    cluster = spec.cluster
    cost = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing,
                     optimizer=spec.job.optimizer, ep=plan.ep)
    fwd, bwd, cap = [], [], []
    for s, st in enumerate(plan.stages):
        gpu = cluster.gpu(cluster.dc(st.dc).gpu_type)
        t = cost.stage_times(st.units, gpu, plan.micro_batch, plan.stage_tp(s))
        fwd.append(t.forward)
        bwd.append(t.backward)
        k, tp = plan.pp, plan.stage_tp(s)
        while k < plan.num_microbatches and cost.stage_memory(
                st.units, gpu, plan.micro_batch, k + 1, plan.sharding, plan.dp, tp).total <= gpu.memory_bytes:
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
