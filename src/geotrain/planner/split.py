"""Balanced layer split: cut the model's units into contiguous stages of equal *time*.

Stages may sit on different GPU types, so balancing unit counts is wrong: a stage on a GPU three
times faster should hold about three times the work. Each stage s gets a prefix-sum table of
per-unit time on its own GPU (embedding and head included), and we look for the contiguous cut
minimising the slowest stage. For a bound T the greedy "take as many units as fit in T" is an
exact feasibility test (taking more never hurts the stages after it), so a bisection on T over
prefix sums finds the optimum in O(pp log(units) log(1/eps)) -- fast enough to run inside the search.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

from geotrain.errors import InfeasibleError


def prefix_sums(values: Sequence[float]) -> list[float]:
    """[0, v0, v0+v1, ...]: the time of units [a, b) is p[b] - p[a]."""
    return [0.0, *accumulate(values)]


def _greedy(prefixes: Sequence[Sequence[float]], bound: float) -> list[int] | None:
    """Cut points (ends of stages) if every stage fits in `bound`, else None."""
    n = len(prefixes[0]) - 1
    parts = len(prefixes)
    ends, start = [], 0
    for s, p in enumerate(prefixes):
        left_for_rest = parts - s - 1
        if s == parts - 1:
            end = n
            if p[end] - p[start] > bound:
                return None
        else:
            end = min(bisect_right(p, p[start] + bound) - 1, n - left_for_rest)
            if end <= start:
                return None
        ends.append(end)
        start = end
    return ends


def balanced_split(prefixes: Sequence[Sequence[float]], rel_tol: float = 1e-4) -> list[tuple[int, int]]:
    """Contiguous unit ranges, one per stage, minimising the slowest stage's time.

    prefixes[s]: prefix sums of per-unit time on stage s's GPU (all the same length, units + 1).
    Every stage gets at least one unit."""
    parts = len(prefixes)
    n = len(prefixes[0]) - 1
    if parts < 1 or parts > n:
        raise ValueError(f"cannot cut {n} units into {parts} stages")
    # The bound lies between the largest single unit on the fastest GPU and everything on the slowest.
    kinds = list({id(p): p for p in prefixes}.values())   # stages on one GPU type share a prefix list
    lo = max(min(p[u + 1] - p[u] for p in kinds) for u in range(n)) * 0.999
    hi = max(p[n] for p in prefixes)
    best = _greedy(prefixes, hi)
    if best is None:  # cannot happen: one bound that holds everything
        raise ValueError("no split found")
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        ends = _greedy(prefixes, mid)
        if ends is None:
            lo = mid
        else:
            hi, best = mid, ends
    starts = [0, *best[:-1]]
    return list(zip(starts, best, strict=True))


def split_even(num_units: int, parts: int) -> list[tuple[int, int]]:
    """Cut units 0..num_units into `parts` contiguous, near-equal ranges (by count, not time)."""
    if parts > num_units:
        raise InfeasibleError(f"cannot cut {num_units} model units into {parts} pipeline stages")
    base, extra = divmod(num_units, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out
