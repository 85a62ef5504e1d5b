"""Region layouts: DP across the DCs of one region (zones joined by fast links).

Atlas's rule keeps every DP replica of a stage in the stage's DC, so the gradient reduction
never crosses the WAN. Between zones of one cloud region the links can be fast enough for the
reduction to cross them (Sailor's headline plan: PP1/DP32 over four zones), and for a small
model pure DP over every DC can beat any pipeline. A region layout keeps each DP pipeline
whole inside one DC -- its activations never cross a link -- and spreads the pipelines over a
set of DCs of one region; only the gradient sync crosses, priced hierarchically
(costs.comm.cross_dc_sync_time). It is one more candidate: the estimate and the simulator decide,
so over WAN-slow links the plan keeps DP inside DCs.

Which sets: every subset (of two or more) of the DCs a cluster puts in one `region`, each pair
linked, with alike hardware (one GPU type, node size and intra-DC network, so every pipeline
runs the same program). A cluster with no regions gets none: spreading DP over a WAN is then
not considered at all.
"""

from __future__ import annotations

from itertools import combinations

from geotrain.planner.chains import MICRO_BATCHES, Layout, _fill, schedule_kinds
from geotrain.planner.context import PlanningContext
from geotrain.planner.placement import distribute_ranked, iter_dp, pp_candidates
from geotrain.spec.job import MAX_MICROBATCHES

MAX_REGION_DCS = 8   # subsets of a region's DCs are listed: past this many, only the whole region


def _hardware(ctx: PlanningContext, name: str) -> tuple:
    d = ctx.dc(name)
    return d.gpu_type, d.gpus_per_node, d.intra_node_gbps, d.intra_dc_gbps, d.intra_dc_latency_us


def region_sets(ctx: PlanningContext) -> list[tuple[str, ...]]:
    """The DC sets a region layout may spread over (see the module docstring), largest DC first."""
    regions: dict[str, list[str]] = {}
    for d in ctx.cluster.datacenters:
        if d.region is not None:
            regions.setdefault(d.region, []).append(d.name)
    out = []
    for names in regions.values():
        sizes = range(2, len(names) + 1) if len(names) <= MAX_REGION_DCS else [len(names)]
        for k in sizes:
            for group in combinations(names, k):
                if len({_hardware(ctx, n) for n in group}) != 1:
                    continue
                if any(ctx.link(a, b) is None for a, b in combinations(group, 2)):
                    continue
                if not all(ctx.tp_fits(n) for n in group) or not ctx.owns(group):
                    continue   # (alike hardware: one kind of DC, so one tp over the group)
                out.append(tuple(sorted(group, key=lambda n: -ctx.dc(n).gpus)))
    return out


def region_layouts(ctx: PlanningContext) -> list[Layout]:
    """Every (DC set, micro-batch, pp, dp) a region layout allows, with the bound of a one-DC
    pipeline (ideal compute, fill) plus the cross-DC sync's part no split can avoid: the first
    stage's (with pp = 1 the whole model's; else the embedding's) over the region's links."""
    job = ctx.job
    gb = job.global_batch
    mbs = [job.micro_batch] if isinstance(job.micro_batch, int) else [b for b in MICRO_BATCHES if gb % b == 0]
    sharding = ctx.sharding_options()
    if not sharding:
        return []
    out = []
    for group in region_sets(ctx):
        gpus = [ctx.dc(n).gpus for n in group]
        home = group[0]
        tp = ctx.tp_of(home)
        kinds = schedule_kinds(ctx, 1)
        for mb in mbs:
            tab = ctx.dc_table(home, mb, ctx.checkpointing_options()[0])
            work = tab.step[-1]
            fill = min(_fill(kind, [tab], [work]) for kind in kinds)
            for pp in ([job.pp] if job.pp is not None else pp_candidates(1, min(ctx.model.layers, min(gpus) // tp))):
                caps = tuple(g // (pp * tp) for g in gpus)
                if min(caps) < 1:
                    continue
                first = ((0, ctx.num_units),) if pp == 1 else ((0, 1),)
                for dp in iter_dp(gb, mb, sum(caps)):
                    if dp < len(group) or (job.dp is not None and dp != job.dp):
                        continue
                    m = gb // (dp * mb)
                    if m > MAX_MICROBATCHES:
                        continue
                    reps = distribute_ranked(dp, caps, ((0, 0),) * len(group))
                    if reps is None:
                        continue
                    sync = min(ctx.allreduce_span(first, group, reps, s, m) for s in sharding)   # the leanest
                    out.append(Layout((home,), (pp,), dp, mb, m, (m - 1) * work / pp + fill + sync,
                                      span=group, replicas=reps))
    return out
