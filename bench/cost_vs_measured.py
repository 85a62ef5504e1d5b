"""Cost model vs the real model on this machine: per-unit times predicted from FLOPs on the
built-in "cpu" GPU type, next to times measured with geotrain.calibrate.timers (as the runtime runs them), in one run.

    .venv/bin/python bench/cost_vs_measured.py [--model small] [--micro-batches 1 4] [--repeats 5]

The ratio column (measured / predicted) is what the "cpu" GPU type's peak x efficiency would need
to absorb; the profile printed at the end can be fed to `geotrain estimate --profile`.
"""

from __future__ import annotations

import argparse
import json

from geotrain.calibrate.timers import measure_units
from geotrain.console import format_table, human_seconds
from geotrain.costs import CostModel
from geotrain.models.presets import PRESETS
from geotrain.spec.cluster import BUILTIN_GPU_TYPES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small", choices=sorted(PRESETS))
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--micro-batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    spec, cpu = PRESETS[args.model], BUILTIN_GPU_TYPES["cpu"]
    for precision in args.precision:
        prof = measure_units(spec, args.micro_batches, precision, args.repeats)
        cost = CostModel(spec, precision=precision)
        rows = []
        for kind, unit in (("embedding", 0), ("block", 1), ("head", spec.layers + 1)):
            for mb in args.micro_batches:
                t = cost.stage_times([unit], cpu, mb)
                f, b = prof[kind][str(mb)]
                rows.append([precision, kind, mb, human_seconds(t.forward), human_seconds(f),
                             f"{f / t.forward:.2f}" if t.forward else "-", human_seconds(t.backward),
                             human_seconds(b), f"{b / t.backward:.2f}" if t.backward else "-"])
        print(format_table(["dtype", "unit", "mb", "fwd pred", "fwd meas", "ratio", "bwd pred", "bwd meas",
                            "ratio"], rows))
        print(f"profile ({precision}): {json.dumps(prof)}\n")


if __name__ == "__main__":
    main()
