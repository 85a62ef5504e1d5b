"""geotrain validate SPEC...: check cluster, model and experiment files.

Every file is checked (not just up to the first bad one) so one run lists every broken file;
each problem is one line naming the file, the field and the reason, and the exit status is 2
if any file failed.
"""

from __future__ import annotations

import argparse
import sys

HELP = "validate cluster, model and experiment spec files"
ORDER = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("specs", nargs="+", metavar="SPEC", help="TOML files (experiment, cluster or model)")


def run(args: argparse.Namespace) -> int:
    from geotrain.config.load import validate_file
    from geotrain.errors import GeotrainError

    failed = 0
    for path in args.specs:
        try:
            print(f"ok  {validate_file(path)}")
        except GeotrainError as e:
            print(f"geotrain validate: error: {' '.join(str(e).split())}", file=sys.stderr)
            failed += 1
    return 2 if failed else 0
