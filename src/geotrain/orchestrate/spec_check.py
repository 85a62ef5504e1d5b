"""`geotrain validate`: check spec files the way every later command would.

Every file is checked (not just up to the first bad one) so one run lists every broken file; each
problem is one line naming the file, the field and the reason. An experiment gets every check the
later commands make, so "valid" means estimate, plan and simulate accept it: the spec's own fields
and bounds, that the job's pins can be placed on linked datacenters and fit in memory (the
planner's placement, `plan_from_job`), and its [bubbletea] workload.
"""

from __future__ import annotations

from geotrain.bubbletea.simulated import parse_workload
from geotrain.errors import GeotrainError
from geotrain.planner.manual import plan_from_job
from geotrain.spec.load import Spec, is_experiment, load_spec, validate_file


def validate_files(paths: list[str], say=print, complain=print) -> int:
    """Check each file; `say` gets "ok  SUMMARY", `complain` the one-line error. Returns how many failed."""
    failed = 0
    for path in paths:
        try:
            summary = validate_file(path)
            if is_experiment(path):
                check_experiment(path)
            say(f"ok  {summary}")
        except GeotrainError as e:
            complain(" ".join(str(e).split()))
            failed += 1
    return failed


def load_experiment(path) -> Spec:
    """An experiment TOML as every command loads it: the spec, with its [bubbletea] workload
    checked (only `simulate --bubbletea` reads it, but a spec validate refuses is refused by
    plan, train and the rest alike, not accepted by some)."""
    spec = load_spec(path)
    if spec.bubbletea is not None:
        parse_workload(None, spec.bubbletea)
    return spec


def check_experiment(path: str) -> None:
    """What estimate, plan and simulate check after loading the spec (raises GeotrainError)."""
    spec = load_experiment(path)
    plan_from_job(spec, virtual_per_stage=2 if spec.job.schedule == "interleaved" else 1)
