"""Predicted peak memory per stage of a plan under its schedule -- what the planner's fit check
stands for, set beside the run's measurement (`runtime.measured_memory`), in the simulator's metrics and in
`geotrain estimate`. Here, below both the runtime and the simulator, so they predict alike."""

from __future__ import annotations

from geotrain.costs import CostModel, MemoryBreakdown
from geotrain.schedule.checks import peak_held


def predicted_stage_peaks(spec, plan, schedule) -> list[MemoryBreakdown]:
    """The cost model's peak per stage (one GPU of it) for this plan and its schedule: the
    number the planner checked against GPU memory, to set beside the measured peak. Each stage
    with its own checkpointing mode (`Plan.stage_checkpointing`)."""
    return [b for b, _, _ in stage_peaks(spec, plan, schedule)]


def stage_peaks(spec, plan, schedule, cost: CostModel | None = None) -> list[tuple[MemoryBreakdown, float, float]]:
    """Per stage: (predicted peak, micro-batches held, of which between B and W), the counts as
    whole-stage equivalents.

    The schedule is scanned for each stage's worst moment with every chunk weighed by its own
    bytes per micro-batch (`schedule.checks.peak_held`): interleaved chunks differ (the first
    has the embedding, the last the head, every other one an fp32 input), and a split backward's
    micro-batches between B and W keep their hooked gradients (`CostModel.deferred_bytes`).
    `cost`: the model to use (under any checkpointing mode; each stage gets its own)."""
    if cost is None:
        cost = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing,
                         optimizer=spec.job.optimizer, ep=plan.ep)
    costs = {mode: cost.with_checkpointing(mode) for mode in {plan.stage_checkpointing(s) for s in range(plan.pp)}}
    vunits = plan.virtual_units()
    mb, pp = plan.micro_batch, plan.pp

    def chunk_held(v: int) -> float:
        return costs[plan.stage_checkpointing(v % pp)].microbatch_activation_bytes(range(*vunits[v]), mb,
                                                                                    plan.stage_tp(v % pp))

    def chunk_deferred(v: int) -> float:
        return costs[plan.stage_checkpointing(v % pp)].deferred_bytes(range(*vunits[v]), mb, plan.stage_tp(v % pp))

    peaks = peak_held(schedule, chunk_held, chunk_deferred)
    out = []
    for s, st in enumerate(plan.stages):
        cost = costs[plan.stage_checkpointing(s)]
        tp = plan.stage_tp(s)
        gpu = spec.cluster.gpu(spec.cluster.dc(st.dc).gpu_type)
        held_bytes, deferred_bytes = peaks[s]
        per_mb = cost.microbatch_activation_bytes(st.units, mb, tp)
        per_deferred = cost.deferred_bytes(st.units, mb, tp)
        held = held_bytes / per_mb if per_mb else 0.0
        deferred = deferred_bytes / per_deferred if per_deferred else 0.0
        out.append((cost.stage_memory(st.units, gpu, mb, held, plan.sharding, plan.dp, tp,
                                      num_microbatches=plan.num_microbatches, deferred=deferred), held, deferred))
    return out
