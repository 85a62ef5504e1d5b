"""geotrain validate SPEC...: check cluster, model and experiment files (`orchestrate.spec_check`).

Each problem is one line naming the file, the field and the reason; the exit status is 2 if any
file failed."""

from __future__ import annotations

import argparse
import sys

from geotrain.orchestrate.spec_check import validate_files


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("specs", nargs="+", metavar="SPEC", help="TOML files (experiment, cluster or model)")


def run(args: argparse.Namespace) -> int:
    failed = validate_files(args.specs, complain=lambda msg: print(f"geotrain validate: error: {msg}",
                                                                    file=sys.stderr))
    return 2 if failed else 0
