"""geotrain profile SPEC: measure this machine's compute, collective and transfer costs for a job."""

from __future__ import annotations

import argparse
import time

from geotrain.errors import GeotrainError

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
    # lazy: numpy, pydantic, torch, tqdm only when the command runs (keeps `geotrain --help` fast)
    from geotrain.calibrate.measure import measure_profile
    from geotrain.calibrate.profile_file import save_profile
    from geotrain.spec.load import load_spec

    spec = load_spec(args.spec)
    if args.micro_batch and min(args.micro_batch) < 1:
        raise GeotrainError("--micro-batch must be at least 1")
    t0 = time.time()
    prof = measure_profile(spec, quick=args.quick, micro_batches=args.micro_batch, mode=args.wan,
                           progress=lambda msg: print(f"  {time.time() - t0:5.1f} s  {msg}", flush=True))
    save_profile(prof, args.out)
    rt = prof["runtime"]
    mb = rt["micro_batches"][0]
    print(f"profile of {spec.model.name} ({rt['precision']}, micro-batch {mb}) in {time.time() - t0:.0f} s "
          f"-> {args.out}")
    for kind in ("embedding", "block", "head"):
        f, b = prof[kind][str(mb)]
        print(f"  {kind:<9} forward {1e3 * f:7.3f} ms  backward {1e3 * b:7.3f} ms")
    opt = rt["optimizer"]
    print(f"  optimizer {1e3 * opt['fixed_s']:.3f} ms + {1e9 * opt['per_param_s']:.2f} ns/param; "
          f"per-action overhead {1e6 * rt['per_action_s']:.0f} us; start-up {rt['startup_s']:.1f} s")
    for n, fit in rt["allreduce"].items():
        print(f"  all-reduce dp={n}: {1e3 * fit['alpha_s']:.3f} ms + {fit['per_byte_s'] * 1e9:.3f} ns/byte")
    print("  contention (slow-down with k ranks computing): "
          + ", ".join(f"k={k} x{v:.2f}" for k, v in rt["contention"].items())
          + f" (other runnable threads meanwhile: {rt['background_runnable']:.1f})")
    print("  runtime compute factor: " + ", ".join(f"{k} x{v:.2f}" for k, v in rt["compute_factor"].items()))
    cal = rt["calibration_run"]
    print(f"  calibration run ({cal['wan_mode']} WAN): WAN message overhead "
          f"{1e3 * rt['wan_message_overhead_s']:.2f} ms, "
          f"global loss/overflow all-reduce {1e3 * cal.get('global_sync_s', 0.0):.2f} ms, "
          f"iteration {1e3 * cal['measured_iteration_s']:.1f} ms")
    if "wan_messages" in rt:
        wm = rt["wan_messages"]
        print("  WAN message probe (isolated, receiver waiting): overhead "
              + ", ".join(f"{1e3 * v:.2f} ms at {k} ms" for k, v in wm["overhead_s"].items())
              + f"; back-to-back gap {1e3 * wm['gap_s']:.2f} ms per message")
    if "wan" in rt:
        achieved = rt["wan"]["achieved_gbps"]
        print("  WAN achieved: " + ", ".join(f"{n} conn {g * 1000:.0f} Mb/s" for n, g in achieved.items()))
    return 0
