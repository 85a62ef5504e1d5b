"""geotrain estimate SPEC: the cost model's view of a job, unit by unit and stage by stage."""

from __future__ import annotations

import argparse

from geotrain.orchestrate.estimate_run import print_estimate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC", help="experiment TOML file (cluster + model + job)")
    p.add_argument("--profile", metavar="JSON",
                   help="measured per-unit times replacing the FLOP estimate (format: geotrain.costs.unit_times)")


def run(args: argparse.Namespace) -> int:
    print_estimate(args.spec, args.profile)
    return 0
