"""Planner benchmark.

1. Planning time per example (search, and simulating the finalists, apart), wall and CPU time --
   CPU because these machines are shared: the wall time under load says little. Targets: the
   five-zone full mesh (opt350m_a100_5zone) <= 1 s, the 8,192-GPU example < 2 s.
2. The plan against the exhaustive optimum (geotrain.planner.exhaustive, every plan simulated) on
   the small clusters of tests/test_plan_exhaustive.py: planner / optimum (goal <= 1.01).
3. Per example: the chosen plan's simulated iteration time vs its lower bound, vs each baseline,
   and its price: $/iteration and $/1M tokens from the DCs' price_per_gpu_hour plus WAN egress at
   each link's egress_usd_per_gb (geotrain.layout.price; no example sets an egress price, so pass
   --egress USD_PER_GB to price every link alike).

Run: .venv/bin/python bench/bench_planner.py [--quick]   (--quick: only part 1)
"""

from __future__ import annotations

import argparse
import dataclasses
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


def price(spec, plan, iteration_s: float) -> tuple[float, float, float] | None:
    """($ per iteration, $ per 1M tokens, of which egress $ per iteration), or None when a DC has
    no price."""
    from geotrain.layout.price import cost_per_iteration, cost_per_mtoken, egress_per_iteration

    egress = egress_per_iteration(spec, plan)
    it = cost_per_iteration(spec.cluster, plan, iteration_s, egress)
    if it is None:
        return None
    return it, cost_per_mtoken(spec.cluster, plan, iteration_s, spec.model.seq_len, egress), egress


def with_egress(spec, usd_per_gb: float | None):
    """The spec with every WAN link's egress price set (None: as the spec says)."""
    if usd_per_gb is None:
        return spec
    links = [lk.model_copy(update={"egress_usd_per_gb": usd_per_gb}) for lk in spec.cluster.wan_links]
    return dataclasses.replace(spec, cluster=spec.cluster.model_copy(update={"wan_links": links}))


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

    from test_plan_exhaustive import CASES, OPT, write_spec

    from geotrain.planner.exhaustive import all_plans
    from geotrain.sim import simulate

    print("\n[2] planner vs exhaustive optimum (every plan simulated)")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (dcs, links, job, *opt) in sorted(CASES.items()):
            spec = write_spec(Path(tmp) / name, dcs, links, OPT if opt else "llama2-7b", job, name=name,
                              region="r1" if opt else None)
            plans, t_enum, _ = _timed(lambda spec=spec: all_plans(spec))
            best = min(simulate(spec, p).metrics.iteration_time for p in plans)
            chosen = make_plan(spec).iteration_s
            print(f"    {name:<10} {len(plans):>5} plans: optimum {best:.4f} s, planner {chosen:.4f} s, "
                  f"ratio {chosen / best:.4f} -> {'PASS' if chosen <= 1.01 * best else 'FAIL'} (<= 1.01)")


def examples(load_spec, make_plan, evaluate_baselines, GeotrainError, egress: float | None = None) -> None:
    print("\n[3] every example: simulated plan vs lower bound and baselines; price")
    for f in sorted((ROOT / "examples").glob("*.toml")):
        try:
            spec = with_egress(load_spec(f), egress)
            res = make_plan(spec, top_k=3)
        except GeotrainError as e:
            print(f"    {f.stem:<26} error: {e}")
            continue
        cells = [f"{b.name} {b.iteration_s:.2f}s ({b.iteration_s / res.iteration_s:.2f}x)" if b.ok
                 else f"{b.name} n/a" for b in evaluate_baselines(spec)]
        cost = price(spec, res.plan, res.iteration_s)
        money = (f"${cost[0]:.2f}/iteration (egress ${cost[2]:.2f}), ${cost[1]:.3f}/1M tokens" if cost
                 else "no prices")
        print(f"    {spec.name:<26} {res.iteration_s:8.3f} s (bound {res.lower_bound_s:.3f}, "
              f"x{res.iteration_s / res.lower_bound_s:.2f}, {res.bottleneck}); {money}")
        print("        baselines (ours x faster): " + "; ".join(cells))
        if not math.isfinite(res.iteration_s):
            print("        (no finite iteration time)")


def main() -> int:
    from geotrain.errors import GeotrainError
    from geotrain.planner.confirm import evaluate_baselines, make_plan
    from geotrain.spec import load_spec

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the planning times")
    ap.add_argument("--egress", type=float, metavar="USD_PER_GB", help="egress price on every WAN link in [3]")
    args = ap.parse_args()
    planning_times(load_spec, make_plan)
    if args.quick:
        return 0
    against_exhaustive(make_plan)
    examples(load_spec, make_plan, evaluate_baselines, GeotrainError, args.egress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
