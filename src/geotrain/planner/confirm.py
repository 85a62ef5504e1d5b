"""Plan, then confirm by simulation: the planner lists its finalists (geotrain.planner.search),
the simulator scores each, the fastest wins. Also the baselines' simulated numbers and what-if
sweeps, which re-plan per value. The plan layer never simulates; this module joins the two.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from geotrain.errors import GeotrainError, InfeasibleError
from geotrain.layout import price
from geotrain.planner import baselines, modes, whatif
from geotrain.planner.context import PlanningContext
from geotrain.planner.objective import Objective
from geotrain.planner.search import PlanResult, conclude, money_finalists, shortlist
from geotrain.sim import simulate
from geotrain.spec.load import Spec


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Planning allocates millions of short-lived objects that reference counting frees; the cyclic
    collector would re-scan every live object again and again (docs/DECISIONS.md, Planner). Paused
    for one planning call and restored after, whatever happens; what cycles it made are collected
    at the next automatic pass."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@cyclic_gc_paused()
def make_plan(spec: Spec, *, top_k: int = 3, progress: bool = False, simulate_finalists: bool = True,
              log: Callable[[str], None] | None = None, objective: str = "throughput",
              max_cost_per_hour: float | None = None, min_tokens_per_s: float | None = None,
              min_speed: float | None = None, profile: dict | None = None) -> PlanResult:
    """Search, then simulate the `top_k` best estimates (their variants and the upgraded
    baselines) and keep the best simulated plan by `objective` -- throughput (the fastest), cost
    (the lowest $/hour) or cost-per-token (the lowest $/1M tokens) -- among those within
    --max-cost-per-hour, --min-tokens-per-s and `min_speed` x the fastest simulated plan's tokens/s
    (a cost objective's default: planner.objective); without simulation, the best estimate.
    The fastest side is simulated first, so the cost scan holds the floor the choice holds.

    With a cost objective or a budget the search also ranks every layout by it (planner.objective):
    the finalists are the fastest few, the cheapest few and the baselines. `profile` (measured
    unit times, geotrain.costs.unit_times) prices compute in the search and in the simulations alike."""
    goal = Objective(objective, max_cost_per_hour, min_tokens_per_s, min_speed)   # checks them: one line if bad
    short = shortlist(spec, top_k, profile, goal)
    if log:
        log(f"searched {short.layouts} layouts, scored {short.scored} candidates in {short.search_s:.2f} s")
    tokens = spec.job.global_batch * spec.model.seq_len
    if not simulate_finalists:
        if not goal.by_time:
            money_finalists(short, goal, tokens / short.plans[0][1].est.total, top_k)
        return conclude(short, 0)
    t0 = time.perf_counter()

    def run(plans):
        out = []
        for plan, _ in plans:
            cost = short.ctx.cost(plan.checkpointing) if profile is not None else None
            out.append(simulate(spec, plan, iterations=1, cost=cost, progress=progress))
            if log:
                log(f"simulated {plan.name} ({plan.pp} stages x dp {plan.dp}, {plan.schedule}): "
                    f"{out[-1].iteration_time:.3f} s")
        return out

    results = run(short.plans)
    fastest = max(r.tokens_per_s for r in results)    # the floor's reference: the fastest side's best
    if not goal.by_time:
        results = run(money_finalists(short, goal, fastest, top_k)) + results
    simulated = [(plan, r.iteration_time) for (plan, _), r in zip(short.plans, results, strict=True)]
    floor = goal.floored(fastest).min_tokens_per_s
    best = _choose(spec, results, objective, max_cost_per_hour, floor)
    res = conclude(short, best, results[best], simulated, time.perf_counter() - t0)
    res.explanation += _other_side(spec, results, best, objective)
    if goal.min_speed and not goal.by_time:
        res.explanation.append(f"Only plans making at least {goal.min_speed:.0%} of the fastest simulated plan's "
                               f"tokens/s ({floor:,.0f}) competed on price (--min-speed; 0: the cheapest at any "
                               f"speed).")
    return modes.apply_cross_dc(spec, res, make_plan)      # [job] cross_dc: DiLoCo, auto, compression


def _choose(spec: Spec, results, objective: str, max_cost_per_hour: float | None,
            min_tokens_per_s: float | None) -> int:
    """Index of the finalist the objective prefers among those meeting the constraints."""
    cl, seq = spec.cluster, spec.model.seq_len
    needs_price = objective != "throughput" or max_cost_per_hour is not None
    ok, why = [], []
    egress = [price.egress_per_iteration(spec, r.plan) for r in results]
    for i, r in enumerate(results):
        hour = price.cost_per_hour(cl, r.plan, r.iteration_time, egress[i])
        if needs_price and hour is None:
            why.append(f"{r.plan.name} uses a DC without price_per_gpu_hour")
            continue
        if max_cost_per_hour is not None and hour > max_cost_per_hour:
            why.append(f"{r.plan.name} costs ${hour:,.2f}/hour")
            continue
        if min_tokens_per_s is not None and r.tokens_per_s < min_tokens_per_s:
            why.append(f"{r.plan.name} makes {r.tokens_per_s:,.0f} tokens/s")
            continue
        ok.append(i)
    if not ok:
        raise InfeasibleError("no simulated plan meets the constraints: " + "; ".join(why[:4]))

    def key(i: int) -> tuple[float, float]:
        r = results[i]
        t = r.iteration_time
        if objective == "cost":
            return price.cost_per_hour(cl, r.plan, t, egress[i]), t
        if objective == "cost-per-token":
            return price.cost_per_mtoken(cl, r.plan, t, seq, egress[i]), t
        return t, 0.0

    return min(ok, key=key)   # ties: the earlier finalist


def _other_side(spec: Spec, results, chosen: int, objective: str) -> list[str]:
    """Why the simulated plan best on the other axis lost: under throughput the cheapest per token
    (slower), under a cost objective the fastest (dearer). Nothing where prices are missing."""
    def per_mtoken(r):
        return price.cost_per_mtoken(spec.cluster, r.plan, r.iteration_time, spec.model.seq_len,
                                     price.egress_per_iteration(spec, r.plan))
    costs = [per_mtoken(r) for r in results]
    if any(c is None for c in costs):
        return []
    me, t = costs[chosen], results[chosen].iteration_time
    if objective == "throughput":
        i = min(range(len(results)), key=lambda j: (costs[j], results[j].iteration_time))
        if costs[i] >= me:
            return []
        slow = results[i].iteration_time
        return [f"Cheaper simulated plan: {results[i].plan.name} at ${costs[i]:.3g}/1M tokens "
                f"({100 * (1 - costs[i] / me):.0f}% less) lost on time: {slow:.3g} s per iteration, "
                f"{100 * (slow / t - 1):.1f}% slower (--objective cost-per-token takes it)."]
    i = min(range(len(results)), key=lambda j: (results[j].iteration_time, costs[j]))
    if results[i].iteration_time >= t:
        return []
    return [f"Faster simulated plan: {results[i].plan.name} at {results[i].iteration_time:.3g} s per iteration "
            f"({100 * (1 - results[i].iteration_time / t):.0f}% faster) lost on price: ${costs[i]:.3g}/1M tokens "
            f"against ${me:.3g} (or it breaks a constraint)."]


def evaluate_baselines(spec: Spec, ctx: PlanningContext | None = None) -> list[baselines.BaselineResult]:
    """Every baseline's numbers, simulated where it is a plan (dp-across-dcs is analytical)."""
    out = baselines.evaluate_baselines(spec, ctx)
    for r in out:
        if r.plan is not None:
            sim = simulate(spec, r.plan)
            r.sim = sim
            r.iteration_s = sim.metrics.iteration_time
            r.tokens_per_s = sim.metrics.tokens_per_s
            r.utilization = sim.metrics.mean_utilization
            r.wan_bytes = sim.metrics.wan_bytes
    return out


def sweep(spec: Spec, key: str, values: list[str], top_k: int = 2, log=None) -> list[whatif.SweepRow]:
    """Plan (and simulate the baselines) once per value of `key`."""
    from pydantic import ValidationError  # pydantic's error type, only to report a bad value

    rows = []
    for value in values:
        try:
            s = whatif.apply_value(spec, key, value)
        except ValidationError as e:
            raise GeotrainError(f"{key}={value}: {e.errors()[0]['msg']}") from None
        try:
            res = make_plan(s, top_k=top_k)
        except GeotrainError as e:
            rows.append(whatif.SweepRow(value, math.inf, 0.0, "-", note=str(e)))
            continue
        p = res.plan
        summary = f"{'>'.join(whatif.chain_of(p))} pp{p.pp} dp{p.dp} mb{p.micro_batch} {p.schedule}"
        base = {b.name: b.iteration_s for b in evaluate_baselines(s, PlanningContext(s))}
        rows.append(whatif.SweepRow(value, res.iteration_s, res.sim.metrics.tokens_per_s if res.sim else 0.0,
                                    summary, base))
        if log:
            log(f"{key}={value}: {res.iteration_s:.3f} s ({summary})")
    return rows
