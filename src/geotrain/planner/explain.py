"""What a person reads about a plan: lower bound, bottleneck, and why these choices.

Lower bound on the iteration time of a layout (nothing can beat both):
  * the busiest GPU's compute: num_microbatches x (forward + backward) of its stage + its
    optimizer step;
  * the busiest WAN link direction: dp x num_microbatches x boundary bytes over its capacity.
"""

from __future__ import annotations

import math

from geotrain.console import human_bytes, human_seconds
from geotrain.costs.comm import pipeline_chain
from geotrain.layout.plan import Plan
from geotrain.planner.analytic import held
from geotrain.planner.context import GBIT, PlanningContext
from geotrain.planner.plan_score import plan_stage_costs

GIB = 2**30


def _s(x: float) -> str:
    return human_seconds(x)


def _b(x: float) -> str:
    return human_bytes(x)


def _recompute_factor(ctx: PlanningContext, plan: Plan) -> float:
    """Step time with a stage's checkpointing over the step time without, for the stage where
    recomputing costs most (stages may checkpoint differently)."""
    worst = 1.0
    for s, st in enumerate(plan.stages):
        gpu_type = ctx.dc(st.dc).gpu_type
        none = ctx.table(gpu_type, plan.micro_batch, "none").step[-1]
        used = ctx.table(gpu_type, plan.micro_batch, plan.stage_checkpointing(s)).step[-1]
        if none > 0:
            worst = max(worst, used / none)
    return worst


def lower_bound(ctx: PlanningContext, plan: Plan, costs) -> dict[str, float]:
    m = plan.num_microbatches
    compute = max(m * c.step + c.optimizer for c in costs)
    nbytes = ctx.boundary_bytes(plan.micro_batch)
    wan = 0.0
    for lp in plan.links:
        link = ctx.link(lp.src_dc, lp.dst_dc)
        copies = ctx.wan_copies(lp.src_dc, lp.dst_dc)   # one scattered (equal tp), else one per receiving TP rank
        wan = max(wan, plan.dp * m * nbytes * copies / (link.capacity_gbps * GBIT))
    return {"compute": compute, "wan": wan}


def classify(ctx: PlanningContext, plan: Plan, cand, sim_time: float | None) -> str:
    """compute | wan-bandwidth | wan-latency | memory: what keeps the plan from going faster."""
    est = cand.est if cand is not None else None
    if est is not None and est.limiter != "compute":
        return est.limiter
    if _recompute_factor(ctx, plan) > 1.1:
        return "memory"
    if est is not None and plan.links:
        # Fill/drain latency worth more than a fifth of the iteration: the WAN's latency.
        if 2 * est.wan_latency > 0.2 * (sim_time or est.total):
            return "wan-latency"
    return "compute"


def analyse(ctx: PlanningContext, plan: Plan, cand, sim) -> tuple[float, dict[str, float], str, list[str]]:
    costs = plan_stage_costs(ctx, plan)   # per-stage checkpointing, a region's sync: as score_plan prices it
    parts = lower_bound(ctx, plan, costs)
    lb = max(parts.values())
    sim_t = sim.iteration_time if sim is not None else None
    bottleneck = classify(ctx, plan, cand, sim_t)
    return lb, parts, bottleneck, explain(ctx, plan, cand, sim, costs, parts, bottleneck)


def explain(ctx: PlanningContext, plan: Plan, cand, sim, costs, parts, bottleneck) -> list[str]:
    lines = _placement_lines(ctx, plan)
    lines += _split_and_schedule_lines(ctx, plan, costs)
    lines.append(_memory_line(ctx, plan, bottleneck))
    lines += _wan_lines(ctx, plan)
    lb = max(parts.values())
    t = sim.iteration_time if sim is not None else (cand.est.total if cand else math.nan)
    lines.append(f"Lower bound {_s(lb)} (busiest GPU compute {_s(parts['compute'])}, busiest WAN link "
                 f"{_s(parts['wan'])}); plan {_s(t)} = {t / lb:.2f}x the bound; bottleneck: {bottleneck}.")
    if t > 1.15 * lb:
        lines.append("Gap to the bound: " + gap_reason(plan, cand, t, lb))
    return lines


def _placement_lines(ctx: PlanningContext, plan: Plan) -> list[str]:
    """Which DCs and GPUs the plan uses, and why the rest are left out."""
    cl = ctx.cluster
    lines: list[str] = []
    chain = pipeline_chain(st.dc for st in plan.stages)
    used = plan.gpus_per_dc()
    total = sum(used.values())
    if plan.replica_dcs:   # a region plan: whole pipelines per DC, only the gradient sync crosses
        spread = ", ".join(f"{dc} {n}" for dc, n in plan.replicas_per_dc())
        lines.append(f"DP across a region: {plan.dp} pipelines of {plan.pp} stage(s), each inside one DC "
                     f"({spread} pipelines), {total} of {cl.total_gpus} GPUs (tp {plan.tp_label()}); only the "
                     f"gradient sync crosses the region's links.")
    else:
        lines.append(f"Pipeline over {' -> '.join(chain)}: {total} of {cl.total_gpus} GPUs "
                     f"({plan.pp} stages x dp {plan.dp} x tp {plan.tp_label()})."
                     + (f" Expert parallelism: each stage's {plan.ep} consecutive replicas split the experts, "
                        "their all-to-alls inside its DC." if plan.ep > 1 else ""))
    left = [d.name for d in cl.datacenters if d.name not in used]
    if left:
        lines.append(f"Left out: {', '.join(left)} -- every layout using them scored slower (an extra WAN hop "
                     f"or link too slow for the activations), or they are not linked to the chain.")
    for d in cl.datacenters:
        if d.name in used and used[d.name] < d.gpus:
            n = sum(1 for s in plan.stages if s.dc == d.name)
            tp = next((plan.stage_tp(s) for s, st in enumerate(plan.stages) if st.dc == d.name), plan.tp)
            lines.append(f"{d.name}: {used[d.name]} of {d.gpus} GPUs ({n} stage(s) x {plan.dp * tp}); "
                         f"dp must divide the global batch ({ctx.job.global_batch}) and be equal on every stage, "
                         f"and deeper pipelines scored slower.")
    return lines


def _split_and_schedule_lines(ctx: PlanningContext, plan: Plan, costs) -> list[str]:
    lines: list[str] = []
    types = {st.dc: ctx.dc(st.dc).gpu_type for st in plan.stages}
    by_type: dict[str, list[int]] = {}
    for st in plan.stages:
        by_type.setdefault(types[st.dc], []).append(len(st.units))
    steps = [c.step for c in costs]
    lines.append(f"Layer split balanced by per-stage time on each stage's GPU (embedding and head included): "
                 f"slowest stage {_s(max(steps))}, fastest {_s(min(steps))} per micro-batch"
                 + ("; units per stage by GPU type: "
                    + ", ".join(f"{t} avg {sum(v) / len(v):.1f}" for t, v in by_type.items())
                    if len(by_type) > 1 else "") + ".")
    sched = f"Schedule {plan.schedule}"
    if plan.schedule == "wan-1f1b" and plan.extra_warmup:
        sched += f" with extra warm-up {list(plan.extra_warmup)} to cover the WAN round trip"
    if plan.virtual_per_stage > 1:
        sched += f" ({plan.virtual_per_stage} chunks per stage)"
    lines.append(sched + f"; micro-batch {plan.micro_batch} x {plan.num_microbatches} per pipeline.")
    return lines


def _memory_line(ctx: PlanningContext, plan: Plan, bottleneck: str) -> str:
    peak = max(ctx.stage_memory_fraction(st.chunks, st.dc, plan.micro_batch, _inflight(plan, s), plan.sharding,
                                         plan.dp, plan.stage_checkpointing(s)) * ctx.gpu(st.dc).memory_gib
               for s, st in enumerate(plan.stages))
    memory = (f"Memory: checkpointing {plan.checkpointing_label()}, sharding {plan.sharding} -- the cheapest the "
              f"job allows that fits; peak {_b(peak * GIB)} per GPU")
    if bottleneck == "memory":
        slower = f"{100 * (_recompute_factor(ctx, plan) - 1):.0f}%"
        if ctx.job.checkpointing == "auto":
            memory += (f"; this is the bottleneck: without checkpointing the layout does not fit, and recomputing "
                       f"activations makes each micro-batch step {slower} slower")
        else:
            memory += (f"; this is the bottleneck: the job pins checkpointing {plan.checkpointing!r}, whose "
                       f"recompute makes each micro-batch step {slower} slower (checkpointing = \"auto\" lets "
                       f"the planner drop it where memory allows)")
    return memory + "."


def _wan_lines(ctx: PlanningContext, plan: Plan) -> list[str]:
    lines: list[str] = []
    nbytes = ctx.boundary_bytes(plan.micro_batch)
    for lp in plan.links:
        link = ctx.link(lp.src_dc, lp.dst_dc)
        s = (f"WAN {lp.src_dc}<->{lp.dst_dc}: {lp.connections} TCP connection(s) x {link.per_connection_gbps:g} "
             f"Gbit/s = {link.rate_gbps(lp.connections):g} of {link.capacity_gbps:g} Gbit/s, {link.latency_ms:g} ms; "
             f"{_b(nbytes)} per micro-batch each way")
        if lp.sharing == "temporal":
            s += f"; temporal sharing: {plan.dp} pipelines take turns, staggered {_s(lp.stagger_s)}"
        lines.append(s + ".")
    return lines


def _inflight(plan: Plan, s: int):
    return held(plan.schedule, plan.pp, plan.num_microbatches, s, plan.extra_warmup, plan.virtual_per_stage)


def gap_reason(plan: Plan, cand, t: float, lb: float) -> str:
    """Which limit keeps the plan more than 15% above the bound."""
    est = cand.est if cand is not None else None
    if est is None:
        return "unknown (no estimate)"
    why = []
    bubble = est.fill - est.compute_period  # fill/drain beyond one micro-batch slot
    if plan.pp > 1 and bubble > 0.1 * t:
        why.append(f"pipeline fill/drain {_s(bubble)} ({plan.pp} stages over {plan.num_microbatches} "
                   f"micro-batches per pipeline; more micro-batches would need a larger global batch)")
    if est.latency_period > est.compute_period * 1.01:
        why.append(f"WAN round trips stretch each micro-batch slot to {_s(est.latency_period)} "
                   f"(compute {_s(est.compute_period)})")
    if est.bandwidth_period > est.compute_period * 1.01:
        why.append(f"WAN bandwidth: {_s(est.bandwidth_period)} of link time per micro-batch slot")
    if est.tail > 0.05 * t:
        why.append(f"DP all-reduce + optimizer not hidden: {_s(est.tail)}")
    if est.offsets > 0.05 * t:
        why.append(f"temporal-sharing start offsets {_s(est.offsets)}")
    return "; ".join(why) or "imbalance and scheduling dependencies (see the simulated timeline)"


def infeasible_reason(ctx: PlanningContext, tightest=None) -> str:
    """One line: what is missing for the model to be placed at all."""
    cl, job, model = ctx.cluster, ctx.job, ctx.model
    if job.dp is not None and all(d.gpus < job.dp * ctx.tp for d in cl.datacenters):
        return (f"job.dp={job.dp} x tp={ctx.tp} needs {job.dp * ctx.tp} GPUs per stage in one DC, but the largest "
                f"DC has {max(d.gpus for d in cl.datacenters)}")
    if tightest is not None:
        frac, dc, desc = tightest
        gpu = ctx.gpu(dc)
        return (f"{model.name} does not fit: the leanest layout tried ({desc}) needs "
                f"{human_bytes(frac * gpu.memory_gib * 2**30)} "
                f"per GPU in {dc}, whose {ctx.dc(dc).gpu_type} GPUs have {human_bytes(gpu.memory_gib * 2**30)} "
                f"-- use more GPUs "
                f"(deeper pipeline), GPUs with more memory, or allow checkpointing/sharding")
    return (f"{model.name} cannot be placed on {cl.name}: no layout with pp <= {model.layers} stages, equal dp "
            f"dividing global_batch={job.global_batch} and micro-batches >= stages fits the DCs' GPU counts "
            f"({', '.join(f'{d.name}: {d.gpus}' for d in cl.datacenters)})")
