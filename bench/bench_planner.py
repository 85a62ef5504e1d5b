"""Planner benchmark.

1. Planning time per example (search, and simulating the finalists, apart), wall and CPU time --
   CPU because these machines are shared: the wall time under load says little. Targets: the
   five-zone full mesh (opt350m_a100_5zone) <= 1 s, the 8,192-GPU example < 2 s.
2. The plan against the exhaustive optimum (geotrain.plan.exhaustive, every plan simulated) on
   the small clusters of tests/test_plan_exhaustive.py: planner / optimum (goal <= 1.01).
3. Per example: the chosen plan's simulated iteration time vs its lower bound, vs each baseline,
   and its price: $/iteration and $/1M tokens from the DCs' price_per_gpu_hour (GPU-hours only;
   WAN egress is not priced yet).

Run: .venv/bin/python bench/bench_planner.py [--quick]   (--quick: only part 1)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def price(spec, plan, iteration_s: float) -> tuple[float, float] | None:
    """($ per iteration, $ per 1M tokens) from GPU-hours, or None when a DC has no price."""
    per_hour = 0.0
    for dc, n in plan.gpus_per_dc().items():
        p = spec.cluster.dc(dc).price_per_gpu_hour
        if p is None:
            return None
        per_hour += n * p
    it = per_hour * iteration_s / 3600
    return it, it / (plan.global_batch * spec.model.seq_len) * 1e6


def planning_times(load_spec, make_plan) -> None:
    print(f"[1] planning time (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    targets = {"opt350m_a100_5zone": 1.0, "llama2_70b_4dc_8k": 2.0}
    for f in sorted((ROOT / "examples").glob("*.toml")):
        spec = load_spec(f)
        res, wall, cpu = _timed(lambda spec=spec: make_plan(spec, top_k=3))
        goal = targets.get(f.stem)
        verdict = f"  target {goal:g} s: {'PASS' if cpu <= goal else 'FAIL'} (CPU)" if goal else ""
        print(f"    {f.stem:<26} {len(spec.cluster.datacenters)} DCs {spec.cluster.total_gpus:>5} GPUs: "
              f"wall {wall:6.2f} s, CPU {cpu:5.2f} s (search {res.search_s:.2f} s wall, "
              f"{res.candidates_scored} candidates; {len(res.finalists)} finalists simulated "
              f"{res.simulate_s:.2f} s wall){verdict}")


def against_exhaustive(make_plan) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import tempfile

    from test_plan_exhaustive import CASES, write_spec

    from geotrain.plan.exhaustive import all_plans
    from geotrain.sim import simulate

    print("\n[2] planner vs exhaustive optimum (every plan simulated)")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (dcs, links, job) in sorted(CASES.items()):
            spec = write_spec(Path(tmp) / name, dcs, links, "llama2-7b", job, name=name)
            plans, t_enum, _ = _timed(lambda spec=spec: all_plans(spec))
            best = min(simulate(spec, p).metrics.iteration_time for p in plans)
            chosen = make_plan(spec).iteration_s
            print(f"    {name:<10} {len(plans):>5} plans: optimum {best:.4f} s, planner {chosen:.4f} s, "
                  f"ratio {chosen / best:.4f} -> {'PASS' if chosen <= 1.01 * best else 'FAIL'} (<= 1.01)")


def examples(load_spec, make_plan, evaluate_baselines, GeotrainError) -> None:
    print("\n[3] every example: simulated plan vs lower bound and baselines; price")
    for f in sorted((ROOT / "examples").glob("*.toml")):
        try:
            spec = load_spec(f)
            res = make_plan(spec, top_k=3)
        except GeotrainError as e:
            print(f"    {f.stem:<26} error: {e}")
            continue
        cells = [f"{b.name} {b.iteration_s:.2f}s ({b.iteration_s / res.iteration_s:.2f}x)" if b.ok
                 else f"{b.name} n/a" for b in evaluate_baselines(spec)]
        cost = price(spec, res.plan, res.iteration_s)
        money = f"${cost[0]:.2f}/iteration, ${cost[1]:.3f}/1M tokens" if cost else "no prices"
        print(f"    {spec.name:<26} {res.iteration_s:8.3f} s (bound {res.lower_bound_s:.3f}, "
              f"x{res.iteration_s / res.lower_bound_s:.2f}, {res.bottleneck}); {money}")
        print("        baselines (ours x faster): " + "; ".join(cells))
        if not math.isfinite(res.iteration_s):
            print("        (no finite iteration time)")


def main() -> int:
    from geotrain.config import load_spec
    from geotrain.errors import GeotrainError
    from geotrain.orchestrate.planning import evaluate_baselines, make_plan

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the planning times")
    args = ap.parse_args()
    planning_times(load_spec, make_plan)
    if args.quick:
        return 0
    against_exhaustive(make_plan)
    examples(load_spec, make_plan, evaluate_baselines, GeotrainError)
    return 0


if __name__ == "__main__":
    sys.exit(main())
