"""geotrain replan RUN_DIR: a new plan for the cluster that is left after losing a DC or GPUs.

The work is `orchestrate.replan_run`; the plan it writes is what
`geotrain train NEW_PLAN --resume-from RUN_DIR` continues the run's last checkpoint on."""

from __future__ import annotations

import argparse

from geotrain.errors import GeotrainError
from geotrain.orchestrate.replan_run import replan_command

DESCRIPTION = ("Write a new plan for RUN_DIR's model, global batch and optimizer on what is left of its cluster, "
               "print what changed and the simulated iteration time before and after.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `geotrain train` run directory (its plan.json)")
    p.add_argument("--without", action="append", default=[], metavar="DC", help="drop this datacenter (repeatable)")
    p.add_argument("--gpus", action="append", default=[], metavar="DC=N",
                   help="this datacenter now has N GPUs (repeatable; 0 drops it)")
    p.add_argument("--spec", default=None, metavar="NEW_SPEC",
                   help="take the cluster from this experiment file (same model and global batch)")
    p.add_argument("--out", default=None, metavar="PLAN.json", help="where to write the plan (RUN_DIR/replan.json)")
    p.add_argument("--top-k", type=int, default=2, metavar="K", help="plans confirmed by simulation (default 2)")


def parse_gpus(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, n = item.partition("=")
        if not sep or not name or not n.strip().isdigit():
            raise GeotrainError(f"--gpus expects DC=N with N a whole number >= 0 (got {item!r})")
        out[name.strip()] = int(n)
    return out


def run(args: argparse.Namespace) -> int:
    replan_command(args.run_dir, args.without, parse_gpus(args.gpus), args.spec, top_k=args.top_k, out=args.out)
    return 0
