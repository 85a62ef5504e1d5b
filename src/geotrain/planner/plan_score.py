"""The analytical estimate of an existing plan (baselines, explanations, the exhaustive check):
its layout, per-stage costs and boundaries as the search's scorer prices a layout
(`planner.scorer`), each stage at its own checkpointing mode and tp (`StagePlan.tp`: a hand-made
plan may hold stages of two tps in one DC, priced in a context of each; the simulator is exact
per stage too).
"""

from __future__ import annotations

from dataclasses import replace

from geotrain.layout.plan import Plan
from geotrain.planner.analytic import StageTerms, finish, pipeline_part
from geotrain.planner.candidate import Candidate
from geotrain.planner.chains import Layout
from geotrain.planner.context import PlanningContext
from geotrain.planner.scorer import Scorer
from geotrain.planner.sharing import offsets_span


def plan_layout(plan: Plan) -> Layout:
    """The Layout an existing plan has: its DC chain with stages per DC, and for a region plan
    the DCs its pipelines spread over."""
    chain: list[str] = []
    counts: list[int] = []
    for st in plan.stages:
        if chain and chain[-1] == st.dc:
            counts[-1] += 1
        else:
            chain.append(st.dc)
            counts.append(1)
    spread = plan.replicas_per_dc() if plan.replica_dcs else []
    return Layout(tuple(chain), tuple(counts), plan.dp, plan.micro_batch, plan.num_microbatches,
                  span=tuple(d for d, _ in spread), replicas=tuple(n for _, n in spread))


def stage_contexts(ctx: PlanningContext, plan: Plan) -> list[PlanningContext] | None:
    """Per stage, a context pricing it at its own tp (StagePlan.tp, None = the plan's) -- for a
    hand-made plan whose DC holds stages of two tps, which one context (a tp per DC) cannot price;
    None when `ctx` has every stage's DC at that stage's tp."""
    if all(ctx.tp_of(st.dc) == plan.stage_tp(s) for s, st in enumerate(plan.stages)):
        return None
    made: dict[tuple[str, int], PlanningContext] = {}
    out = []
    for s, st in enumerate(plan.stages):
        key = (st.dc, plan.stage_tp(s))
        if key not in made:
            made[key] = ctx if ctx.tp_of(st.dc) == key[1] else PlanningContext(
                ctx.spec, ctx.profile, tps={**ctx.tps, st.dc: key[1]})
        out.append(made[key])
    return out


def plan_stage_costs(ctx: PlanningContext, plan: Plan, scorer: Scorer | None = None) -> list[StageTerms]:
    """An existing plan's per-stage costs as the search prices them: each stage at its own
    checkpointing mode and tp, the DP sync across the region's DCs for a region plan."""
    scorer = scorer or Scorer(ctx, kinds=(plan.schedule,))
    modes = tuple(plan.stage_checkpointing(s) for s in range(plan.pp))
    dcs, chunks, lay = [st.dc for st in plan.stages], tuple(st.chunks for st in plan.stages), plan_layout(plan)
    ctxs = stage_contexts(scorer.ctx, plan)
    if ctxs is None:
        return scorer.stage_costs(dcs, chunks, plan.micro_batch, modes, plan.sharding, plan.dp, lay)
    costs = [c for s in range(plan.pp)   # one stage at a time, each in the context of its tp
             for c in Scorer(ctxs[s], kinds=(plan.schedule,)).stage_costs(
                 [dcs[s]], (chunks[s],), plan.micro_batch, (modes[s],), plan.sharding, plan.dp, lay)]
    tied = ctx.costs.plan_tied_sum(plan)   # the first and last stage's gradient sum, as the simulator adds it
    if tied:
        costs[0] = replace(costs[0], allreduce=costs[0].allreduce + tied)
        costs[-1] = replace(costs[-1], allreduce=costs[-1].allreduce + tied)
    return costs


def score_plan(ctx: PlanningContext, plan: Plan) -> Candidate | None:
    """The analytical estimate of an existing plan (for baselines and the explanation), every
    stage at its own tp."""
    ctx = ctx.for_plan(plan)   # costs are per tp: a plan of other tps is priced in a context of its own
    lay = plan_layout(plan)
    chain = lay.chain
    sharing = "temporal" if any(lp.sharing == "temporal" for lp in plan.links) else "fair"
    scorer = Scorer(ctx, kinds=(plan.schedule,))
    conns = tuple(lp.connections for lp in plan.links)
    if len(conns) != len(chain) - 1:
        return None
    bounds, stagger = scorer.boundaries(lay, sharing, conns, plan.virtual_per_stage, stage_contexts(ctx, plan))
    modes = tuple(plan.stage_checkpointing(s) for s in range(plan.pp))
    costs = plan_stage_costs(ctx, plan, scorer)
    wan_lat = sum(ctx.link(a, b).latency_ms * 1e-3 for a, b in zip(chain, chain[1:]))
    part = pipeline_part(costs, bounds, plan.num_microbatches, plan.schedule, plan.virtual_per_stage,
                         plan.extra_warmup)
    # Without start offsets the dp pipelines queue for their turns on the link at every micro-batch:
    # the last one waits as long as the offsets would have spread them (as the scorer prices it).
    span = max(plan.pipeline_offsets, default=0.0) or (
        offsets_span(plan.dp, stagger, part.period) if sharing == "temporal" else 0.0)
    est = finish(part, costs, bounds, span, wan_lat)
    return Candidate(lay, plan.schedule, plan.virtual_per_stage, plan.checkpointing, plan.sharding,
                     tuple(s.chunks for s in plan.stages), plan.extra_warmup, sharing, conns, est, plan.name, plan.tp,
                     stage_checkpointing=modes if len(set(modes)) > 1 else (), tps=ctx.key)
