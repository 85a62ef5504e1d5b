"""geotrain plan SPEC: where and how to train across these DCs, and how fast it will go."""

from __future__ import annotations

import argparse

from geotrain.orchestrate.plan_run import plan_command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC", help="experiment TOML file")
    p.add_argument("--out", metavar="PLAN.json", help="write the chosen plan file")
    p.add_argument("--compare", action="store_true", help="also run the baselines and print a comparison")
    p.add_argument("--sweep", metavar="KEY=V1,V2,...",
                   help="re-plan for each value: wan.latency_ms, wan.capacity_gbps, wan.per_connection_gbps, "
                        "dc.<name>.gpus, model")
    p.add_argument("--plot", metavar="PNG", help="sweep plot file (default: sweep-<key>.png)")
    p.add_argument("--top-k", type=int, default=3, metavar="K", help="plans confirmed by simulation (default 3)")
    p.add_argument("--objective", choices=("throughput", "cost", "cost-per-token"), default="throughput",
                   help="pick among the simulated finalists the fastest (default), the lowest $/hour, or the "
                        "lowest $/1M tokens (GPU-hours at each DC's price_per_gpu_hour)")
    p.add_argument("--max-cost-per-hour", type=float, metavar="USD", help="only plans costing at most this per hour")
    p.add_argument("--min-tokens-per-s", type=float, metavar="N", help="only plans training at least this fast")
    p.add_argument("--min-speed", type=float, metavar="F",
                   help="only plans making at least F x the fastest plan's tokens/s (a cost objective's default: "
                        "0.5 unless --min-tokens-per-s is given; 0: the cheapest at any speed)")
    p.add_argument("--profile", metavar="JSON", help="plan with measured per-unit times (a `geotrain profile` "
                                                    "file or the geotrain.costs.unit_times format) instead of FLOPs")
    p.add_argument("--pareto", metavar="PNG", help="draw $/1M tokens vs tokens/s of the simulated finalists, "
                                                  "the chosen plan marked")


def run(args: argparse.Namespace) -> int:
    plan_command(args.spec, out=args.out, compare=args.compare, top_k=args.top_k, objective=args.objective,
                 max_cost_per_hour=args.max_cost_per_hour, min_tokens_per_s=args.min_tokens_per_s,
                 min_speed=args.min_speed,
                 profile_path=args.profile, pareto=args.pareto, sweep=args.sweep, plot=args.plot)
    return 0
