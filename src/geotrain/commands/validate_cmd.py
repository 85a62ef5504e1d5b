"""geotrain validate SPEC...: check cluster, model and experiment files.

Every file is checked (not just up to the first bad one) so one run lists every broken file;
each problem is one line naming the file, the field and the reason, and the exit status is 2
if any file failed. An experiment gets every check the later commands make, so "valid" means
estimate, plan and simulate accept it: the spec's own fields and bounds, that the job's pins can
be placed on linked datacenters and fit in memory (the planner's placement, `plan_from_job`),
and its [bubbletea] workload.
"""

from __future__ import annotations

import argparse
import sys

from geotrain.errors import GeotrainError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("specs", nargs="+", metavar="SPEC", help="TOML files (experiment, cluster or model)")


def run(args: argparse.Namespace) -> int:
    # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.spec.load import is_experiment, validate_file

    failed = 0
    for path in args.specs:
        try:
            summary = validate_file(path)
            if is_experiment(path):
                _check_experiment(path)
            print(f"ok  {summary}")
        except GeotrainError as e:
            print(f"geotrain validate: error: {' '.join(str(e).split())}", file=sys.stderr)
            failed += 1
    return 2 if failed else 0


def _check_experiment(path: str) -> None:
    """What estimate, plan and simulate check after loading the spec (raises GeotrainError)."""
    # lazy: numpy, pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.bubbletea.simulated import parse_workload
    from geotrain.planner.manual import plan_from_job
    from geotrain.spec.load import load_spec

    spec = load_spec(path)
    plan_from_job(spec, virtual_per_stage=2 if spec.job.schedule == "interleaved" else 1)
    if spec.bubbletea is not None:
        parse_workload(None, spec.bubbletea)
