"""geotrain simulate SPEC --out DIR: predict one training plan on its cluster and report it."""

from __future__ import annotations

import argparse

from geotrain.orchestrate.simulate_run import simulate_command

DESCRIPTION = (
    "Simulate the plan of an experiment spec (the layout its [job] pins, or a plan file from "
    "`geotrain plan`) with the discrete-event simulator, then write DIR/trace.jsonl, "
    "DIR/trace.chrome.json (open in ui.perfetto.dev), DIR/timeline.png, DIR/metrics.json, "
    "DIR/plan.json and DIR/report.html, which also compares every schedule kind on the same layout."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC_OR_PLAN",
                   help="experiment TOML (cluster + model + [job]), or a plan file (it carries its experiment)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--plan", metavar="PLAN.json", help="plan file to simulate instead of the job's own layout")
    p.add_argument("--schedule", metavar="KIND",
                   help="schedule kind (gpipe, 1f1b, interleaved, zb-h1, wan-1f1b); default: the plan's / job's")
    p.add_argument("--iterations", type=int, default=1, metavar="N", help="iterations to simulate (default 1)")
    p.add_argument("--no-compare", action="store_true", help="skip simulating the other schedule kinds")
    p.add_argument("--no-progress", action="store_true", help="never show progress bars")
    p.add_argument("--no-timeline", action="store_true",
                   help="write no DIR/timeline.png (report.html without it): drawing it is most of a small plan's "
                        "simulate")
    p.add_argument("--p2p", choices=("overlapped", "blocking"), default="overlapped",
                   help="how the runtime moves pipeline tensors: overlapped (geotrain's: a send does not wait "
                        "for its receive, the default) or blocking (DeepSpeed's pipe engine: blocking send/recv in "
                        "its TrainSchedule order; 1F1B inside one DC)")
    p.add_argument("--profile", metavar="JSON", help="simulate with measured per-unit times (a `geotrain profile` "
                                                    "file or the geotrain.costs.unit_times format: tables at "
                                                    "(micro-batch, tp) points, interpolated) instead of FLOPs")
    p.add_argument("--bubbletea", metavar="WORKLOAD", nargs="?", const="spec",
                   help="also serve prefill requests from the bubbles: a TOML file, key=value pairs "
                        "(e.g. load=0.8,mean_prompt=512,inference_model=llama2-7b) or nothing for the "
                        "spec's [bubbletea] table / defaults")


def run(args: argparse.Namespace) -> int:
    simulate_command(args.spec, args.out, plan_path=args.plan, schedule=args.schedule, iterations=args.iterations,
                     compare=not args.no_compare, progress=not args.no_progress, p2p=args.p2p,
                     profile_path=args.profile, bubbletea=args.bubbletea,
                     timeline=not args.no_timeline, say=lambda line: print(line, flush=True))
    return 0
