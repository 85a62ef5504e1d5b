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

from geotrain.plan.context import PlanningContext
from geotrain.plan.layouts import Layout, layout_bound
from geotrain.plan.scorer import Candidate, Scorer


def search(ctx: PlanningContext, scorer: Scorer, layouts: list[Layout], keep: int = 8,
           deadline_s: float | None = None) -> list[Candidate]:
    """Score layouts in lower-bound order until the bound passes the keep-th best estimate.

    A layout's bound assumes the lightest checkpointing; when its first stage cannot hold even
    the least a schedule keeps in flight under the leanest sharding, that checkpointing cannot
    fit, so the layout goes back into the queue with the bound of the next one (lazily, only for
    layouts the scan reaches) -- under memory pressure the plain bound let thousands of layouts
    through that only fit with recomputation."""
    heap = [(lay.bound, i, lay, 0, False) for i, lay in enumerate(layouts)]
    heapq.heapify(heap)
    best: list[Candidate] = []
    t0 = time.perf_counter()
    options = ctx.checkpointing_options()
    while heap:
        bound, i, lay, level, refined = heapq.heappop(heap)
        if len(best) >= keep and bound >= best[-1].est.total:
            break
        if deadline_s is not None and best and time.perf_counter() - t0 > deadline_s:
            break
        if level < len(options) - 1 and not scorer.may_fit(lay, options[level]):
            heapq.heappush(heap, (max(bound, layout_bound(ctx, lay, options[level + 1])), i, lay, level + 1, False))
            continue
        if not refined:
            # The bound from the real split, for the layouts the scan reaches: most of the
            # scoring went to layouts whose uneven split put them far behind (8k example: 2x).
            tight = scorer.split_bound(lay, options[level])
            if tight is not None and tight > bound * (1 + 1e-9):
                heapq.heappush(heap, (tight, i, lay, level, True))
                continue
        cand = scorer.score(lay, skip=level, cutoff=best[-1].est.total if len(best) >= keep else math.inf)
        if cand is None:
            continue
        best.append(cand)
        best.sort(key=lambda c: c.est.total)
        del best[keep:]
    return best
