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

4. Per example and objective (throughput, cost-per-token, cost): the whole `geotrain plan`
   command in its own process -- its plan, simulated iteration, $/iteration, $/1M tokens and CPU
   time (interpreter start and imports included; targets: five zones <= 1 s, 8,192 GPUs <= 2 s),
   and cost-per-token with --min-speed 0 (the cheapest plan at any speed).
5. The compute model's calibration: costs.roofline per (model, GPU, micro-batch, tp) against the
   published per-layer profiles (calibrate.roofline_fit; bench/data/gpu_runs).

Run: .venv/bin/python bench/bench_planner.py [--quick | --objectives | --calibration] [--write-docs]
(--quick: part 1; --objectives: part 4; --calibration: part 5; --write-docs: part 4's table into
the README and part 5's into docs/DECISIONS.md, between their markers)
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


OBJECTIVES = ("throughput", "cost-per-token", "cost")


def whole_command(load_spec, only: list[str] | None = None) -> str:
    """Part 4: one `geotrain plan EXAMPLE --objective O --out F` process per cell, its CPU time from
    the children's rusage, its plan and price read back from the plan file; the cost objectives keep
    their default floor (half the fastest plan's tokens/s), the last row of each example lifts it
    (`--min-speed 0`: the cheapest at any speed)."""
    import json
    import resource
    import subprocess
    import tempfile

    from geotrain.layout.plan import load_plan

    print(f"\n[4] the whole plan command per example and objective (load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores)")
    rows = ["| example | objective | plan | iteration s | $/iteration | $/1M tokens | CPU s (whole command) |",
            "|---|---|---|---|---|---|---|"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    with tempfile.TemporaryDirectory() as tmp:
        for f in sorted((ROOT / "examples").glob("*.toml")):
            if only and f.stem not in only:
                continue
            spec = load_spec(f)
            for objective, anyspeed in [(o, False) for o in OBJECTIVES] + [("cost-per-token", True)]:
                out = Path(tmp) / f"{f.stem}-{objective}-{anyspeed}.json"
                extra = ["--min-speed", "0"] if anyspeed else []
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                run = subprocess.run([sys.executable, "-m", "geotrain.cli", "plan", str(f), "--objective", objective,
                                      "--out", str(out), *extra], env=env, capture_output=True, text=True)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
                label = objective + (" --min-speed 0" if extra else "")
                if run.returncode != 0:
                    rows.append(f"| {f.stem} | {label} | {run.stderr.strip()[-80:]} | | | | {cpu:.2f} |")
                    continue
                plan, doc = load_plan(out)
                t = float(json.loads(out.read_text()).get("simulated_s", doc.get("simulated_s", math.nan)))
                where = ", ".join(f"{dc} {n}" for dc, n in plan.gpus_per_dc().items())
                what = (f"pp{plan.pp} x dp{plan.dp} x tp{plan.tp_label()}, "
                        f"mb {plan.micro_batch} x {plan.num_microbatches}")
                cost = price(spec, plan, t)
                money = (f"{cost[0]:.3g} | {cost[1]:.3g}" if cost else "- | -")
                rows.append(f"| {f.stem} | {label} | {what} ({where}) | {t:.3g} | {money} | {cpu:.2f} |")
                print("    " + rows[-1], flush=True)
    return "\n".join(rows)


def calibration() -> str:
    from geotrain.calibrate.gpu_runs import load_gpu_runs
    from geotrain.calibrate.roofline_fit import fit_markdown, fit_rows, score_passes_left

    print("\n[5] costs.roofline against the published per-layer profiles (one block, forward + backward)")
    data = load_gpu_runs(ROOT / "bench" / "data" / "gpu_runs")
    table = fit_markdown(fit_rows(data)) + "\n\n" + "\n".join(f"- {line}" for line in score_passes_left(data))
    print(table)
    return table


def main() -> int:
    from geotrain.errors import GeotrainError
    from geotrain.planner.confirm import evaluate_baselines, make_plan
    from geotrain.spec import load_spec

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the planning times")
    ap.add_argument("--egress", type=float, metavar="USD_PER_GB", help="egress price on every WAN link in [3]")
    ap.add_argument("--objectives", action="store_true", help="only part 4: the whole command per objective")
    ap.add_argument("--calibration", action="store_true", help="only part 5: the compute model's fit")
    ap.add_argument("--only", metavar="EX1,EX2", help="part 4 on these examples only (file stems)")
    ap.add_argument("--write-docs", action="store_true", help="part 4 into the README, part 5 into DECISIONS.md")
    args = ap.parse_args()
    if args.objectives or args.calibration:
        from _doc_sections import replace_section

        if args.objectives:
            table = whole_command(load_spec, args.only.split(",") if args.only else None)
            if args.write_docs:
                replace_section(ROOT / "README.md", "<!-- bench_planner objectives -->",
                                "<!-- /bench_planner objectives -->", table)
        if args.calibration:
            table = calibration()
            if args.write_docs:
                replace_section(ROOT / "docs" / "DECISIONS.md", "<!-- bench_planner calibration -->",
                                "<!-- /bench_planner calibration -->", table)
        return 0
    planning_times(load_spec, make_plan)
    if args.quick:
        return 0
    against_exhaustive(make_plan)
    examples(load_spec, make_plan, evaluate_baselines, GeotrainError, args.egress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
