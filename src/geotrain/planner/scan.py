"""The scan: layouts scored in lower-bound order, stopping once the bound passes the keep-th
best estimate (scorer.py scores one layout). Bounds are raised lazily, only for the layouts the
scan reaches -- by the checkpointing a first stage needs, then by the real balanced split --
and the keep-th best so far is handed to the scorer as a cutoff, so kinds already behind it
skip their memory checks. All three are exact: the kept candidates are those of a full scan.
"""

from __future__ import annotations

import heapq
import math
import time

from geotrain.planner.candidate import Candidate
from geotrain.planner.chains import Layout, enumerate_layouts, layout_bound, schedule_kinds
from geotrain.planner.context import PlanningContext, planning_contexts
from geotrain.planner.objective import Objective
from geotrain.planner.regions import region_layouts
from geotrain.planner.scorer import Scorer
from geotrain.planner.sharing import offsets_span
from geotrain.spec.load import Spec


def tp_groups(spec: Spec, profile: dict | None = None, regions: bool = True, mixed_tp: bool = True,
              **scorer_kw) -> list[tuple[PlanningContext, Scorer, list[Layout]]]:
    """(context, scorer, layouts) per assignment of tensor-parallel degrees to DCs the job allows
    (context.tp_assignments: one tp, or with tp = "auto" one per kind of DC), the all-smallest
    first; each context lists only the layouts it owns (context.owns), so none is scored twice.
    An assignment under which no sharding the job allows runs is left out when the job leaves
    tp open (a pinned one is reported by pins.pin_problem). `regions`: with the region layouts
    (DP across the DCs of a region, planner/regions.py) the cluster allows. mixed_tp=False: one tp
    for every stage (context.planning_contexts)."""
    ctxs = planning_contexts(spec, profile, mixed_tp)
    out = []
    for ctx in ctxs:
        if ctx is not ctxs[0] and not ctx.sharding_options():     # (the first: for pins.pin_problem to name)
            continue
        layouts = enumerate_layouts(ctx)
        if regions:
            layouts += region_layouts(ctx)
        if ctx.ep > 1:
            layouts = [lay for lay in layouts if ep_fits(ctx, lay)]
        out.append((ctx, Scorer(ctx, **scorer_kw), layouts))
    return out


def ep_fits(ctx: PlanningContext, lay) -> bool:
    """Can a layout run the context's expert parallelism: ep divides dp, and each EP group (ep
    consecutive pipelines) stays in one DC -- a region layout's DP groups span DCs, so each DC's
    pipelines must come in whole groups unless the job pins ep (then the WAN carries its all-to-alls)."""
    if lay.dp % ctx.ep:
        return False
    return not lay.replicas or isinstance(ctx.job.ep, int) or all(n % ctx.ep == 0 for n in lay.replicas)


def search(ctx: PlanningContext, scorer: Scorer, layouts: list[Layout], keep: int = 8,
           deadline_s: float | None = None) -> list[Candidate]:
    """Score layouts in lower-bound order until the bound passes the keep-th best estimate."""
    return search_groups([(ctx, scorer, layouts)], keep, deadline_s)


def search_groups(groups: list[tuple[PlanningContext, Scorer, list[Layout]]], keep: int = 8,
                  deadline_s: float | None = None, objective: Objective | None = None,
                  strict: list[Candidate] | None = None) -> list[Candidate]:
    """One scan over the layouts of several contexts (one per tensor-parallel degree), so the
    cutoff of the best so far prunes all of them alike. `objective` (planner.objective; default
    throughput): what "best" is -- the layouts are scanned in the order of its bound, so a cost
    objective keeps the cheapest candidates of a full scan.

    A layout's bound assumes the lightest checkpointing; when its first stage cannot hold even
    the least a schedule keeps in flight under the leanest sharding, that checkpointing cannot
    fit, so the layout goes back into the queue with the bound of the next one (lazily, only for
    layouts the scan reaches) -- under memory pressure the plain bound let thousands of layouts
    through that only fit with recomputation.

    `strict`: filled with the best candidate whose estimate meets the throughput floor with no slack
    (the objective's keys let the estimate miss it by CONSTRAINT_SLACK; the cheapest of those hug
    the floor, and the simulator may put them all under it)."""
    rank = objective or Objective()
    tokens = groups[0][0].job.global_batch * groups[0][0].model.seq_len if groups else 0
    tier = [] if strict is not None and rank.min_tokens_per_s else None
    limit = rank.time_limit(tokens)     # an estimate past it breaks the floor: the scorer may stop early
    heap = [(rank.bound(ctx, lay, lay.bound), g, i, lay, 0, False, lay.bound)
            for g, (ctx, _, layouts) in enumerate(groups) for i, lay in enumerate(layouts)
            if rank.admits_layout(ctx, lay, lay.bound)]
    heapq.heapify(heap)
    best: list[tuple[float, Candidate]] = []
    t0 = time.perf_counter()
    while heap:
        key_bound, g, i, lay, level, refined, bound = heapq.heappop(heap)
        if len(best) >= keep and key_bound >= best[-1][0] and (
                tier is None or (tier and key_bound >= tier[0][0])):
            break
        if deadline_s is not None and best and time.perf_counter() - t0 > deadline_s:
            break
        ctx, scorer, _ = groups[g]
        options = ctx.checkpointing_options()
        if level < len(options) - 1 and not scorer.may_fit(lay, options[level]):
            tight = max(bound, layout_bound(ctx, lay, options[level + 1]))
            if not rank.admits_layout(ctx, lay, tight):
                continue
            heapq.heappush(heap, (rank.bound(ctx, lay, tight), g, i, lay, level + 1, False, tight))
            continue
        if not refined:
            # The bound from the real split, for the layouts the scan reaches: most of the
            # scoring went to layouts whose uneven split put them far behind (8k example: 2x).
            tight = split_bound(scorer, lay, options[level])
            if tight is not None and tight > bound * (1 + 1e-9):
                if not rank.admits_layout(ctx, lay, tight):
                    continue
                heapq.heappush(heap, (rank.bound(ctx, lay, tight), g, i, lay, level, True, tight))
                continue
        cutoff = min(rank.time_cutoff(ctx, lay, _cutoff(best, tier, keep)), limit)
        cand = scorer.score(lay, skip=level, cutoff=cutoff)
        if cand is None:
            continue
        key = rank.key(ctx, cand)
        if not math.isfinite(key):
            continue
        _keep_best(best, key, cand, keep)
        if tier is not None and rank.meets_floor(tokens, cand.est.total):
            _keep_best(tier, key, cand, 1)
    if tier is not None:
        strict[:] = [c for _, c in tier]
    return [c for _, c in best]


def _keep_best(best: list[tuple[float, Candidate]], key: float, cand: Candidate, keep: int) -> None:
    best.append((key, cand))
    best.sort(key=lambda kc: kc[0])
    del best[keep:]


def _cutoff(best: list, tier: list | None, keep: int) -> float:
    """The key a candidate must beat to be kept by either list."""
    cut = best[-1][0] if len(best) >= keep else math.inf
    if tier is not None:
        cut = max(cut, tier[0][0] if tier else math.inf)
    return cut


def split_bound(scorer: Scorer, lay: Layout, ckpt: str) -> float | None:
    """A lower bound on every estimate `scorer.score(lay)` can give with `ckpt` or heavier, from the
    real balanced split (the layout's bound assumes a perfect one): the slowest stage sets
    the period, each kind's fill from the stage times, WAN bytes and latencies as in the
    layout's bound. None where the split is not the one scored (interleaved chunks)."""
    kinds = scorer.kinds or schedule_kinds(scorer.ctx, len(lay.chain))
    if "interleaved" in kinds or not scorer.wan_aware:
        return None
    compute = scorer.split_of(lay, ckpt, 1)[1]
    steps = [f + b for f, b, _, _ in compute]
    fills = []
    for kind in kinds:
        if kind == "zb-h1":
            fills.append(sum(f + bi - bw for f, _, bi, bw in compute) + 2 * max(c[3] for c in compute))
        else:
            fills.append(sum(steps))
    t_max = max(steps)
    # Per WAN sharing, the boundary costs score() uses: the busiest link bounds the period,
    # each boundary is crossed twice in the fill, temporal turns add their start spread.
    out = math.inf
    for sharing, _, bounds, stagger in scorer.variants(lay):
        period = max([t_max] + [b.occupancy for b in bounds])
        span = offsets_span(lay.dp, stagger, period) if sharing == "temporal" else 0.0
        out = min(out, (lay.m - 1) * period + 2 * sum(b.delay for b in bounds) + span)
    return out + min(fills)
