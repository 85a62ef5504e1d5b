"""Every plan a small cluster allows, for checking the search against the true optimum.

The search prunes (stage counts per DC fastest GPUs first, a pp ladder, lower-bound cut-off,
cheapest checkpointing/sharding that fits, the top few estimates confirmed). This module prunes
nothing the job leaves open: every chain of linked DCs, every number of stages on each DC of it
(all compositions, not only fastest-first), every tensor-parallel degree the job allows (per kind
of DC with tp = "auto", as the planner's context.tp_assignments), every dp and pp, every micro-batch, schedule kind,
checkpointing and sharding that fits in memory, temporal (lockstep and staggered starts) and
fair WAN sharing, and every region layout (each split of the DP pipelines over a region's DCs).
What it keeps
from the planner are the pieces that are optimal or fixed by construction: the time-balanced
layer split (optimal for per-stage compute), the saturating TCP connection counts and the
wan-1f1b warm-up sized to the WAN round trip within memory.

It only lists plans: scoring them with the simulator is the caller's part (tests and
bench/bench_planner.py), so the plan layer stays below the simulator. Meant for clusters of a
few DCs with a few GPUs each; `limit` guards against a big one.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain as chain_of

from geotrain.costs.activations import SELECTIVE
from geotrain.layout.plan import Plan
from geotrain.planner.analytic import held
from geotrain.planner.candidate import Candidate
from geotrain.planner.chains import MICRO_BATCHES, Layout, schedule_kinds
from geotrain.planner.context import PlanningContext, planning_contexts
from geotrain.planner.placement import chains, iter_dp
from geotrain.planner.plan_score import score_plan
from geotrain.planner.regions import region_sets
from geotrain.planner.scorer import Scorer
from geotrain.planner.sharing import apply_temporal
from geotrain.planner.warmup import fit_warmup, wanted_warmup
from geotrain.spec.job import MAX_MICROBATCHES
from geotrain.spec.load import Spec

DEFAULT_LIMIT = 20_000


def compositions(pp: int, caps: list[int]) -> Iterator[tuple[int, ...]]:
    """Every (c_0, ..., c_{k-1}) with 1 <= c_i <= caps[i] and sum = pp."""
    if not caps:
        if pp == 0:
            yield ()
        return
    rest = sum(caps[1:])
    for c in range(max(1, pp - rest), min(caps[0], pp - (len(caps) - 1)) + 1):
        for tail in compositions(pp - c, caps[1:]):
            yield (c, *tail)


def all_layouts(ctx: PlanningContext) -> Iterator[Layout]:
    job, cl = ctx.job, ctx.cluster
    gb = job.global_batch
    mbs = [job.micro_batch] if isinstance(job.micro_batch, int) else [b for b in MICRO_BATCHES if gb % b == 0]
    for chain in chains(cl):
        if not all(ctx.tp_fits(d) for d in chain) or not ctx.owns(chain):
            continue
        gpus = [cl.dc(d).gpus for d in chain]
        tps = [ctx.tp_of(d) for d in chain]
        for mb in mbs:
            for dp in iter_dp(gb, mb, min(g // t for g, t in zip(gpus, tps))):
                if job.dp is not None and dp != job.dp:
                    continue
                caps = [g // (dp * t) for g, t in zip(gpus, tps)]
                m = gb // (dp * mb)
                if m > MAX_MICROBATCHES:        # more than a schedule holds (spec.job)
                    continue
                for pp in range(len(chain), min(sum(caps), ctx.model.layers) + 1):
                    if job.pp is not None and pp != job.pp:
                        continue
                    for counts in compositions(pp, caps):
                        yield Layout(chain, counts, dp, mb, m)


def all_plans(spec: Spec, limit: int = DEFAULT_LIMIT) -> list[Plan]:
    """Every plan the job allows that fits in memory (see the module docstring), named exhaustive-i."""
    out: list[Plan] = []
    for ctx in planning_contexts(spec):
        _plans_of(ctx, out, limit)
    return out


def region_layouts_all(ctx: PlanningContext) -> Iterator[Layout]:
    """Every region layout (planner/regions.py): each DC set, micro-batch, pp, dp and every split of
    the dp pipelines over the set's DCs (all compositions, not only proportional)."""
    job = ctx.job
    gb = job.global_batch
    mbs = [job.micro_batch] if isinstance(job.micro_batch, int) else [b for b in MICRO_BATCHES if gb % b == 0]
    for group in region_sets(ctx):
        gpus = [ctx.dc(n).gpus for n in group]
        for mb in mbs:
            tp = ctx.tp_of(group[0])   # alike DCs: one tp (regions.region_sets)
            for pp in range(1, min(ctx.model.layers, min(gpus) // tp) + 1):
                if job.pp is not None and pp != job.pp:
                    continue
                caps = [g // (pp * tp) for g in gpus]
                for dp in iter_dp(gb, mb, sum(caps)):
                    m = gb // (dp * mb)
                    if (job.dp is not None and dp != job.dp) or m > MAX_MICROBATCHES:
                        continue
                    for reps in compositions(dp, caps):
                        yield Layout((group[0],), (pp,), dp, mb, m, span=group, replicas=reps)


def _plans_of(ctx: PlanningContext, out: list[Plan], limit: int) -> None:
    for lay in chain_of(all_layouts(ctx), region_layouts_all(ctx)):
        for sharing in (("temporal", "offsets", "fair") if len(lay.chain) > 1 and lay.dp > 1 else ("fair",)):
            for kind in schedule_kinds(ctx, len(lay.chain)):
                for ckpt in ctx.checkpointing_options():
                    for sharding in ctx.sharding_options():
                        plan = _plan(ctx, lay, kind, ckpt, sharding, sharing)
                        if plan is not None:
                            out.append(plan.with_(name=f"exhaustive-{len(out)}"))
                            if len(out) > limit:
                                raise ValueError(f"more than {limit} plans: the cluster is too big to enumerate")


def _plan(ctx: PlanningContext, lay: Layout, kind: str, ckpt: str, sharding: str, sharing: str) -> Plan | None:
    pp, m = lay.pp, lay.m
    v = 2 if kind == "interleaved" else 1
    if v > 1 and (pp < 2 or m % pp or ctx.num_units < pp * v):
        return None
    if kind == "zb-h1" and ckpt in SELECTIVE:
        return None
    if kind in ("1f1b", "wan-1f1b", "zb-h1", "interleaved") and m < pp:
        return None
    # One Scorer per (checkpointing, sharding) choice: it then scores only that combination.
    scorer = Scorer(ctx, sharing=("temporal" if sharing == "offsets" else sharing,), kinds=(kind,))
    dcs = lay.stage_dcs
    chunks = scorer.split(dcs, lay.micro_batch, ckpt, v)
    policy = "fair" if sharing == "fair" else "temporal"
    conns = tuple(scorer.connections(a, b, lay.dp, policy) for a, b in zip(lay.chain, lay.chain[1:]))
    extra: tuple[int, ...] = ()
    if kind == "wan-1f1b":
        compute = scorer.compute_costs(dcs, chunks, lay.micro_batch, ckpt)
        bounds, _ = scorer.boundaries(lay, policy, conns, 1)
        extra = fit_warmup(ctx, lay, chunks, wanted_warmup(compute, bounds, m), sharding, ckpt)
        if not any(extra):
            return None
    if not all(ctx.stage_fits(chunks[s], dcs[s], lay.micro_batch, held(kind, pp, m, s, extra, v), sharding,
                              lay.dp, ckpt) for s in range(pp)):
        return None
    plan = Candidate(lay, kind, v, ckpt, sharding, chunks, extra, "fair", conns, None, tps=ctx.key).to_plan(ctx)
    if sharing != "fair":  # "offsets": staggered starts, wrapped around the estimate's steady-state period
        est = score_plan(ctx, plan)
        plan = apply_temporal(plan, ctx.cluster, ctx.boundary_bytes(lay.micro_batch), est.est.period if est else 0.0,
                              offsets=sharing == "offsets")
    return plan
