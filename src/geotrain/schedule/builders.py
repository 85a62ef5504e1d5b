"""Schedule builders: (kind, pp, micro-batches) -> per-stage action lists.

Each builder returns the compute order per physical stage; `lower` adds the transfers, the DP
reduction and the optimizer step. The compute orders of "gpipe", "1f1b", "interleaved" and
"zb-h1" are those of PyTorch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble (one local stage), so a plan simulated here and run with
torch.distributed.pipelining executes the same order (tests/test_schedule_torch.py checks it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from geotrain.schedule.actions import Action, Op, Schedule
from geotrain.schedule.lower import lower
from geotrain.schedule.schedule_error import ScheduleError
from geotrain.spec.job import MAX_MICROBATCHES

F, B, BI, BW = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT


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


def interleaved_rounds(pp: int, m: int) -> int:
    """Micro-batches per round of PyTorch's (flexible) interleaved 1F1B: m is cut into
    max(1, m // pp) equal rounds, so m must be a multiple of that count (any m that is a
    multiple of pp works, as in Megatron)."""
    rounds = max(1, m // pp)
    if m % rounds:
        raise ScheduleError(f"interleaved 1F1B needs the micro-batch count ({m}) to be a multiple of "
                         f"max(1, m // pp) = {rounds}; use a multiple of pp={pp}")
    return m // rounds


def interleaved_order(pp: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B (depth first), as PyTorch's ScheduleInterleaved1F1B.

    Physical stage r holds virtual stages r, r + pp, ..., r + (v-1) pp. Forwards walk the local
    chunks in rounds of `per_round` micro-batches (chunk 0 for a round, then chunk 1, ...);
    backwards walk them in reverse chunk order. Warm-up: (v-1) * per_round + 2 (pp-1-r)
    forwards, then one forward / one backward, then the remaining backwards."""
    if v < 2:
        raise ScheduleError(f"interleaved 1F1B needs virtual_per_stage >= 2 (got {v}); use '1f1b'")
    per_round = interleaved_rounds(pp, m)
    total = m * v
    orders = []
    for r in range(pp):
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - r), total)

        def fwd_stage(step: int, r: int = r) -> int:
            return ((step // per_round) % v) * pp + r

        def bwd_stage(step: int, r: int = r, warmup: int = warmup) -> int:
            return (v - 1 - ((step - warmup) // per_round) % v) * pp + r

        next_f: dict[int, int] = defaultdict(int)
        next_b: dict[int, int] = defaultdict(int)

        def take(counter: dict[int, int], stage: int) -> int:
            counter[stage] += 1
            return counter[stage] - 1

        acts: list[Action] = []
        for step in range(warmup):
            vs = fwd_stage(step)
            acts.append(Action(F, vs, take(next_f, vs)))
        for step in range(warmup, total):
            vs = fwd_stage(step)
            acts.append(Action(F, vs, take(next_f, vs)))
            vs = bwd_stage(step)
            acts.append(Action(B, vs, take(next_b, vs)))
        for step in range(total, total + warmup):
            vs = bwd_stage(step)
            acts.append(Action(B, vs, take(next_b, vs)))
        orders.append(acts)
    return orders


def zb_h1_order(pp: int, m: int) -> list[list[Action]]:
    """Zero-bubble ZB-H1 (Qi et al. 2024), as PyTorch's ScheduleInterleavedZeroBubble with one
    local stage: the 1F1B order with each backward split into BACKWARD_INPUT (on the critical
    path: it sends the gradient upstream) and BACKWARD_WEIGHT (local). Stage r defers its
    first r weight gradients to the end, where 1F1B leaves stage r idle for about r backward
    steps; everywhere else W follows right after its I. Warm-up as 1F1B. A deferred W still
    needs its micro-batch's stage inputs, so every stage peaks at min(m, pp) micro-batches held:
    1F1B's worst stage (stage 0), hence the same peak memory as 1F1B."""
    orders = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        acts = [Action(F, r, j) for j in range(warmup)]
        backwards = 0
        weights = 0
        for step in range(warmup, m + warmup):
            if step < m:
                acts.append(Action(F, r, step))
            acts.append(Action(BI, r, backwards))
            backwards += 1
            if step - warmup >= r:
                acts.append(Action(BW, r, weights))
                weights += 1
        acts += [Action(BW, r, j) for j in range(weights, m)]
        orders.append(acts)
    return orders


def wan_warmup(pp: int, m: int, extra_warmup: Sequence[int]) -> list[int]:
    """Warm-up forwards per stage for the WAN-aware 1F1B: the 1F1B default plus `extra_warmup`.

    A stage whose warm-up is shorter than its successor's would wait for a gradient its
    successor cannot produce before receiving more forwards (deadlock), so the uncapped warm-up
    must not increase along the pipeline: extra[s] >= extra[s+1] - 1."""
    if len(extra_warmup) != pp:
        raise ScheduleError(f"extra_warmup has {len(extra_warmup)} entries, expected one per stage ({pp})")
    if any(e < 0 for e in extra_warmup):
        raise ScheduleError(f"extra_warmup must be >= 0, got {list(extra_warmup)}")
    raw = [pp - 1 - s + int(e) for s, e in enumerate(extra_warmup)]
    for s in range(pp - 1):
        if raw[s] < raw[s + 1]:
            raise ScheduleError(f"extra_warmup {list(extra_warmup)} would deadlock: stage {s} warms up with "
                             f"{raw[s]} forwards but stage {s + 1} with {raw[s + 1]} (need extra[s] >= "
                             f"extra[s+1] - 1; wan_extra_warmup computes a valid list)")
    return [min(m, w) for w in raw]


def build_gpipe(pp: int, m: int, **_: object) -> Schedule:
    return lower("gpipe", pp, m, gpipe_order(pp, m))


def build_1f1b(pp: int, m: int, **_: object) -> Schedule:
    return lower("1f1b", pp, m, one_f_one_b_order(pp, m))


def build_interleaved(pp: int, m: int, virtual_per_stage: int = 2, **_: object) -> Schedule:
    v = int(virtual_per_stage)
    return lower("interleaved", pp, m, interleaved_order(pp, m, v), virtual_per_stage=v)


def build_zb_h1(pp: int, m: int, **_: object) -> Schedule:
    return lower("zb-h1", pp, m, zb_h1_order(pp, m))


def build_wan_1f1b(pp: int, m: int, extra_warmup: Sequence[int] | None = None, **_: object) -> Schedule:
    """1F1B whose stages before a slow WAN link run `extra_warmup[s]` more warm-up forwards, so
    the link's round trip is covered by work instead of idling (see `wan_extra_warmup`)."""
    extra = list(extra_warmup) if extra_warmup else [0] * pp
    return lower("wan-1f1b", pp, m, one_f_one_b_order(pp, m, wan_warmup(pp, m, extra)))


BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": build_gpipe,
    "1f1b": build_1f1b,
    "interleaved": build_interleaved,
    "zb-h1": build_zb_h1,
    "wan-1f1b": build_wan_1f1b,
}


def build_schedule(kind: str, pp: int, m: int, **kw: object) -> Schedule:
    """Build a schedule by name. Extra keywords go to the builder (e.g. `virtual_per_stage`
    for interleaved, `extra_warmup` for wan-1f1b)."""
    if kind not in BUILDERS:
        raise ScheduleError(f"unknown schedule kind {kind!r} (known: {', '.join(BUILDERS)})")
    if pp < 1 or m < 1:
        raise ScheduleError("a schedule needs at least one stage and one micro-batch")
    if m > MAX_MICROBATCHES:   # its action lists (and the simulation's events) grow with m
        raise ScheduleError(f"{m} micro-batches per step is more than the {MAX_MICROBATCHES} a schedule holds; "
                            f"use a larger micro-batch")
    return BUILDERS[kind](pp, m, **kw)


def schedule_for_plan(plan) -> Schedule:
    """The schedule a plan runs: its kind, pp and micro-batch count, with only the keywords that
    kind uses (chunks per stage for interleaving, extra warm-up for wan-1f1b). The one place
    simulator, runtime and estimates turn a plan into action lists."""
    kw: dict[str, object] = {}
    if plan.virtual_per_stage > 1 or plan.schedule == "interleaved":
        kw["virtual_per_stage"] = plan.virtual_per_stage
    if plan.schedule == "wan-1f1b" and plan.extra_warmup:
        kw["extra_warmup"] = list(plan.extra_warmup)
    try:
        sched = build_schedule(plan.schedule, plan.pp, plan.num_microbatches, **kw)
    except ValueError as e:
        raise ScheduleError(f"plan {plan.name}: cannot build schedule {plan.schedule!r}: {e}") from None
    if sched.num_virtual != plan.pp * plan.virtual_per_stage:
        raise ScheduleError(f"plan {plan.name}: schedule {plan.schedule!r} has {sched.num_virtual} virtual stages "
                            f"but the plan has {plan.pp * plan.virtual_per_stage}")
    return sched
