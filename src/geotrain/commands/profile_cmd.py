"""geotrain profile SPEC: measure this machine's compute, collective and transfer costs for a job."""

from __future__ import annotations

import argparse

from geotrain.calibrate.profile_run import profile_machine

DESCRIPTION = (
    "Measure, the way the runtime runs them (one CPU thread per rank), the forward and backward time of "
    "each model unit at the job's micro-batch size and precision, the optimizer step, the DP all-reduce "
    "over gloo (dp=2 and 4), the achieved WAN rate with 1, 2 and 4 connections, CPU contention between "
    "ranks, the interpreter's per-action overhead, process start-up, and one real 2-stage calibration run. "
    "Writes a profile the cost model uses in place of peak-FLOP estimates and that `geotrain validate-sim "
    "--profile` reuses."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC", help="experiment TOML (model + [job])")
    p.add_argument("--out", default="profile.json", metavar="FILE", help="profile file to write (default profile.json)")
    p.add_argument("--micro-batch", type=int, action="append", metavar="N",
                   help="micro-batch size to time (repeatable; default: the job's)")
    p.add_argument("--quick", action="store_true", help="fewer repeats, dp=2 only (about half the time)")
    p.add_argument("--wan", default="shaper", choices=["auto", "kernel", "shaper"],
                   help="WAN of the calibration run, as `geotrain train --wan` (default shaper); profile with the "
                        "mode the predicted runs will use: the per-message overhead and the global all-reduce "
                        "are measured there")


def run(args: argparse.Namespace) -> int:
    profile_machine(args.spec, args.out, quick=args.quick, micro_batches=args.micro_batch, mode=args.wan,
                    say=lambda line: print(line, flush=True))
    return 0
