"""Schedule builders: (kind, pp, micro-batches) -> per-stage action lists.

Each builder returns the compute order per physical stage; `lower` adds the transfers, the DP
reduction and the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable

from geotrain.schedule.actions import Action, Op, Schedule
from geotrain.schedule.lower import lower

F, B = Op.FORWARD, Op.BACKWARD


def gpipe_order(pp: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards (in forward order, as PyTorch's ScheduleGPipe)."""
    return [[Action(F, s, j) for j in range(m)] + [Action(B, s, j) for j in range(m)] for s in range(pp)]


def one_f_one_b_order(pp: int, m: int, warmup: list[int] | None = None) -> list[list[Action]]:
    """1F1B: stage s runs `warmup[s]` forwards (default pp - 1 - s), then alternates one forward
    and one backward, then drains the remaining backwards."""
    orders = []
    for s in range(pp):
        w = min(m, (pp - 1 - s) if warmup is None else warmup[s])
        acts = [Action(F, s, j) for j in range(w)]
        f, b = w, 0
        while f < m:
            acts.append(Action(F, s, f))
            f += 1
            acts.append(Action(B, s, b))
            b += 1
        acts += [Action(B, s, j) for j in range(b, m)]
        orders.append(acts)
    return orders


def build_gpipe(pp: int, m: int, **_: object) -> Schedule:
    return lower("gpipe", pp, m, gpipe_order(pp, m))


def build_1f1b(pp: int, m: int, **_: object) -> Schedule:
    return lower("1f1b", pp, m, one_f_one_b_order(pp, m))


BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": build_gpipe,
    "1f1b": build_1f1b,
}


def build_schedule(kind: str, pp: int, m: int, **kw: object) -> Schedule:
    """Build a schedule by name. Extra keywords go to the builder (e.g. `virtual_per_stage`
    for interleaved, `extra_warmup` for wan-1f1b)."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown schedule kind {kind!r} (known: {', '.join(BUILDERS)})")
    if pp < 1 or m < 1:
        raise ValueError("a schedule needs at least one stage and one micro-batch")
    return BUILDERS[kind](pp, m, **kw)
