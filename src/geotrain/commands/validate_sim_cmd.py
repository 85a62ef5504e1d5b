"""geotrain validate-sim: run small plans for real, simulate them, compare."""

from __future__ import annotations

import argparse

from geotrain.calibrate.validation_run import validate_gpu, validate_sim

DESCRIPTION = (
    "Profile this machine once (or load --profile), then predict each validation case from the profile alone "
    "and only then run it for real through the runtime's "
    "launcher and WAN (--wan; several latencies and bandwidths, gpipe/1f1b/zb-h1/wan-1f1b, pp x dp 2x1, 2x2, "
    "4x1, fair and temporal sharing, 1 and 4 connections), and print predicted vs measured iteration time "
    "and per-rank bubble time with their errors, per run (--runs) and WAN mode (--wan, the first the headline). Writes "
    "DIR/VALIDATION.md, DIR/results.json and per-case traces."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="4 cases and a quick profile (about 1-2 minutes)")
    p.add_argument("--out", default="runs/validate-sim", metavar="DIR", help="output directory")
    p.add_argument("--profile", metavar="FILE", help="use this profile instead of measuring one")
    p.add_argument("--case", action="append", metavar="NAME", help="run only this case (repeatable)")
    p.add_argument("--steps", type=int, default=6, help="training steps per case (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="first steps discarded (default 2)")
    p.add_argument("--wan", default="kernel,shaper", metavar="MODES",
                   help="comma-separated runtime WAN modes (kernel, shaper, auto), each with its own calibration "
                        "run; the first is the headline (default kernel,shaper)")
    p.add_argument("--runs", type=int, default=1, help="repeat the whole set this many times (default 1)")
    p.add_argument("--gpu-runs", metavar="DIR",
                   help="instead: predict the published GPU training runs in DIR (bench/data/gpu_runs: Sailor's "
                        "OPT-350 on GH200 nodes) from their specs, pinned plans and measured profiles, beside "
                        "the measured iteration time, gradient reduction and memory; writes DIR_OUT/GPU_VALIDATION.md, "
                        "gpu_results.json and per run its spec, plan.json and the imported profile")


def run(args: argparse.Namespace) -> int:
    if args.gpu_runs:
        validate_gpu(args.gpu_runs, args.out)
    else:
        validate_sim(args.out, quick=args.quick, profile_path=args.profile, steps=args.steps, warmup=args.warmup,
                     cases=args.case, modes=args.wan, runs=args.runs)
    return 0
