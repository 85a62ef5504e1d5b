"""geotrain validate SPEC...: check cluster, model and experiment files."""

from __future__ import annotations

import argparse
import sys

HELP = "validate cluster, model and experiment spec files"
ORDER = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("specs", nargs="+", metavar="SPEC", help="TOML files")


def run(args: argparse.Namespace) -> int:
    from geotrain.config.load import validate_file
    from geotrain.errors import GeotrainError

    failed = 0
    for path in args.specs:
        try:
            print(f"ok  {validate_file(path)}")
        except GeotrainError as e:
            print(f"geotrain validate: error: {e}", file=sys.stderr)
            failed += 1
    return 2 if failed else 0
