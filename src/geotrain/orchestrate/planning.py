"""Plan, then confirm by simulation: the planner lists its finalists (geotrain.plan.search),
the simulator scores each, the fastest wins. Also the baselines' simulated numbers and what-if
sweeps, which re-plan per value. The plan layer never simulates; this module joins the two.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from geotrain.config.load import Spec
from geotrain.errors import GeotrainError
from geotrain.plan import baselines, whatif
from geotrain.plan.context import PlanningContext
from geotrain.plan.search import PlanResult, conclude, shortlist
from geotrain.sim import simulate


def make_plan(spec: Spec, *, top_k: int = 3, progress: bool = False, simulate_finalists: bool = True,
              log: Callable[[str], None] | None = None) -> PlanResult:
    """Search, then simulate the `top_k` best estimates (their variants and the upgraded
    baselines) and keep the fastest simulated plan; without simulation, the best estimate."""
    short = shortlist(spec, top_k)
    if log:
        log(f"searched {short.layouts} layouts, scored {short.scored} candidates in {short.search_s:.2f} s")
    if not simulate_finalists:
        return conclude(short, 0)
    t0 = time.perf_counter()
    best, best_t, best_res, simulated = 0, math.inf, None, []
    for i, (plan, _) in enumerate(short.plans):
        res = simulate(spec, plan, iterations=1, progress=progress)
        t = res.metrics.iteration_time
        simulated.append((plan, t))
        if log:
            log(f"simulated {plan.name} ({plan.pp} stages x dp {plan.dp}, {plan.schedule}): {t:.3f} s")
        if t < best_t:
            best, best_t, best_res = i, t, res
    return conclude(short, best, best_res, simulated, time.perf_counter() - t0)


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
