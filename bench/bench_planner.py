"""Planner benchmark.

1. Planning time for the 70B example on 4 DCs with 8,192 GPUs (target: < 10 s), search and
   simulation of the finalists timed separately.
2. For every experiment in examples/: the chosen plan's simulated iteration time vs its lower
   bound (within 15%, or which limit keeps it from there) and vs each baseline (simulated;
   dp-across-dcs analytical).

Run: .venv/bin/python bench/bench_planner.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    from geotrain.config import load_spec
    from geotrain.errors import GeotrainError
    from geotrain.orchestrate.planning import evaluate_baselines, make_plan

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the 8,192-GPU planning time")
    args = ap.parse_args()

    big = ROOT / "examples" / "llama2_70b_4dc_8k.toml"
    spec = load_spec(big)
    assert spec.cluster.total_gpus == 8192 and len(spec.cluster.datacenters) == 4
    t0 = time.perf_counter()
    res = make_plan(spec, top_k=3)
    total = time.perf_counter() - t0
    print(f"[1] {spec.name}: {spec.model.name}, {len(spec.cluster.datacenters)} DCs, {spec.cluster.total_gpus} GPUs")
    print(f"    planning time {total:.2f} s (search {res.search_s:.2f} s, {res.candidates_scored} candidates scored; "
          f"simulating {len(res.finalists)} finalists {res.simulate_s:.2f} s) -> "
          f"{'PASS' if total < 10 else 'FAIL'} (< 10 s)")
    p = res.plan
    print(f"    chosen: pp {p.pp} x dp {p.dp}, {p.schedule}, GPUs {p.gpus_per_dc()}, simulated {res.iteration_s:.3f} s")
    if args.quick:
        return 0

    print("\n[2] every example: simulated plan vs lower bound and baselines")
    print(f"    {'experiment':<26} {'plan s':>8} {'bound s':>8} {'ratio':>6}  {'bottleneck':<13} "
          "baselines (ours x faster)")
    worst = math.inf
    for f in sorted((ROOT / "examples").glob("*.toml")):
        try:
            spec = load_spec(f)
            res = make_plan(spec, top_k=3)
        except GeotrainError as e:
            print(f"    {f.stem:<26} error: {e}")
            continue
        ratio = res.iteration_s / res.lower_bound_s
        cells = []
        for b in evaluate_baselines(spec):
            if b.ok:
                sp = b.iteration_s / res.iteration_s
                worst = min(worst, sp)
                cells.append(f"{b.name} {b.iteration_s:.2f}s ({sp:.2f}x)")
            else:
                cells.append(f"{b.name} n/a")
        print(f"    {spec.name:<26} {res.iteration_s:>8.3f} {res.lower_bound_s:>8.3f} {ratio:>6.2f}  "
              f"{res.bottleneck:<13} " + "; ".join(cells))
        if ratio > 1.15:
            gap = [line for line in res.explanation if line.startswith("Gap to the bound")]
            print(f"        > 15% above the bound: {gap[0][len('Gap to the bound: '):] if gap else '?'}")
    print(f"\n    smallest speedup over any baseline: {worst:.3f}x -> {'PASS' if worst >= 0.9999 else 'FAIL'} "
          f"(plan never slower)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
