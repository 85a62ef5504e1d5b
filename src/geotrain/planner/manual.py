"""The plan of a job that pins its layout (pp, dp, ...): placed by the planner's own search.

`simulate`, `train`, `estimate` and the calibration runs use this when they get a spec and no
plan file, so a pinned job is laid out the way `geotrain plan` lays it out: the same layout
enumeration (DC chains, stages per DC fastest GPUs first, a time-balanced layer split), the same
memory fitting and the same analytical score -- only the simulator's confirmation of the best few
is left to the caller above (`geotrain plan`, `geotrain simulate` and `geotrain train` all go
through it). What is pinned stays pinned; what is "auto" the search chooses.

A pin that cannot be placed says why with the numbers of each DC (`planner.pins`).
"""

from __future__ import annotations

from geotrain.costs.activations import SELECTIVE
from geotrain.errors import InfeasibleError
from geotrain.layout.plan import Plan
from geotrain.planner.candidate import Candidate
from geotrain.planner.chains import Layout
from geotrain.planner.context import PlanningContext
from geotrain.planner.explain import infeasible_reason
from geotrain.planner.pins import ZB_SELECTIVE, pin_problem
from geotrain.planner.scan import search_groups, tp_groups
from geotrain.planner.scorer import Scorer
from geotrain.planner.split import split_even
from geotrain.spec.load import Spec


def plan_from_job(spec: Spec, schedule: str | None = None, virtual_per_stage: int = 1, fit: bool = True) -> Plan:
    """The planner's best layout (by its analytical estimate) among those the job allows.

    schedule / virtual_per_stage: force a schedule kind (virtual_per_stage 2 means interleaved).
    fit=False: when nothing fits in memory, the placement of the layout with the lowest bound
    anyway, with the job's first checkpointing/sharding choices (what `estimate` reports on)."""
    kind = schedule or ("interleaved" if virtual_per_stage > 1 else None)
    # tp = "auto": every tp (per kind of DC), one scan; no region layouts (so `simulate`/`train` of a bare
    # spec keep each stage's replicas in its DC)
    groups = tp_groups(spec, regions=False, kinds=(kind,) if kind else None)
    ctx, scorer, layouts = groups[0]
    problem = pin_problem(ctx)
    if problem:
        raise InfeasibleError(problem)
    if kind == "zb-h1" and len(ctx.checkpointing_options()) == 1 and ctx.checkpointing_options()[0] in SELECTIVE:
        raise InfeasibleError(ZB_SELECTIVE)
    best = search_groups(groups, keep=1)
    if best:
        return best[0].to_plan(ctx).with_(name=spec.name)
    if fit and layouts or not layouts:
        raise InfeasibleError(infeasible_reason(ctx, scorer.tightest))
    return _unfitted(ctx, scorer, min(layouts, key=lambda lay: lay.bound), kind).with_(name=spec.name)


def _unfitted(ctx: PlanningContext, scorer: Scorer, lay: Layout, kind: str | None) -> Plan:
    kind = kind or (ctx.job.schedule if ctx.job.schedule != "auto" else "1f1b")
    v = 2 if kind == "interleaved" else 1
    ckpt = ctx.checkpointing_options()[0]
    chunks = scorer.split(lay.stage_dcs, lay.micro_batch, ckpt, v)
    conns = tuple(scorer.connections(a, b, lay.dp, "fair") for a, b in zip(lay.chain, lay.chain[1:]))
    return Candidate(lay, kind, v, ckpt, ctx.sharding_options()[0], chunks, (), "fair", conns, None).to_plan(ctx)


__all__ = ["plan_from_job", "split_even"]
