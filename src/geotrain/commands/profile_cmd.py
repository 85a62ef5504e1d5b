"""geotrain profile SPEC: measure this machine's compute, collective and transfer costs for a job."""

from __future__ import annotations

import argparse

from geotrain.calibrate.gpu_runs import import_sailor_profile
from geotrain.calibrate.profile_run import profile_machine
from geotrain.errors import GeotrainError
from geotrain.trace.schema import json_text

DESCRIPTION = (
    "Measure, the way the runtime runs them (one CPU thread per rank), the forward and backward time of "
    "each model unit at the job's micro-batch size and precision, the optimizer step, the DP all-reduce "
    "over gloo (dp=2 and 4), the achieved WAN rate with 1, 2 and 4 connections, CPU contention between "
    "ranks, the interpreter's per-action overhead, process start-up, and one real 2-stage calibration run. "
    "Writes a profile the cost model uses in place of peak-FLOP estimates and that `geotrain validate-sim "
    "--profile` reuses. Or, with --import-sailor, measure nothing: import a published per-layer GPU profile "
    "(Sailor's, per micro-batch and tp) as the same table format."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC", nargs="?", help="experiment TOML (model + [job]); not with --import-sailor")
    p.add_argument("--out", default="profile.json", metavar="FILE", help="profile file to write (default profile.json)")
    p.add_argument("--micro-batch", type=int, action="append", metavar="N",
                   help="micro-batch size to time (repeatable; default: the job's)")
    p.add_argument("--quick", action="store_true", help="fewer repeats, dp=2 only (about half the time)")
    p.add_argument("--wan", default="shaper", choices=["auto", "kernel", "shaper"],
                   help="WAN of the calibration run, as `geotrain train --wan` (default shaper); profile with the "
                        "mode the predicted runs will use: the per-message overhead and the global all-reduce "
                        "are measured there")

    p.add_argument("--import-sailor", metavar="DIR",
                   help="instead of measuring: write --model's per-layer profile on --gpu from DIR (the gpu_runs "
                        "folder format, bench/data/gpu_runs: Sailor's profiles.json and models.json) as a table "
                        "per (micro-batch, tp) that plan/simulate --profile read")
    p.add_argument("--model", metavar="NAME", help="with --import-sailor: the profiled model (e.g. OPT-350)")
    p.add_argument("--gpu", metavar="NAME", help="with --import-sailor: the profiled GPU (e.g. GH-96, A100-40)")


def run(args: argparse.Namespace) -> int:
    if args.import_sailor:
        if args.spec or not (args.model and args.gpu):
            raise GeotrainError("profile --import-sailor DIR takes --model and --gpu, and no SPEC")
        table = import_sailor_profile(args.import_sailor, args.model, args.gpu)
        with open(args.out, "w") as f:
            f.write(json_text(table, indent=1) + "\n")
        print(f"wrote {args.out}: {args.model} on {args.gpu}, {len(table['block'])} (micro-batch, tp) points, "
              f"unit kinds {', '.join(k for k in ('embedding', 'block', 'head') if k in table)}")
        return 0
    if not args.spec:
        raise GeotrainError("profile: SPEC is required (or --import-sailor DIR --model M --gpu G)")
    profile_machine(args.spec, args.out, quick=args.quick, micro_batches=args.micro_batch, mode=args.wan,
                    say=lambda line: print(line, flush=True))
    return 0
