"""`geotrain validate-sim`: the validation set run and compared (`validation`), or the published GPU
runs predicted (`gpu_validation`), and their tables written beside the results."""

from __future__ import annotations

import json
from pathlib import Path

from geotrain.calibrate.gpu_runs import load_gpu_runs
from geotrain.calibrate.gpu_table import gpu_markdown
from geotrain.calibrate.gpu_validation import validate_gpu_runs
from geotrain.calibrate.profile_file import load_profile
from geotrain.calibrate.validation import run_validation
from geotrain.errors import GeotrainError


def validate_sim(out: str, quick: bool = False, profile_path: str | None = None, steps: int = 6, warmup: int = 2,
                 cases: list[str] | None = None, modes: str = "kernel,shaper", runs: int = 1, say=print) -> None:
    """Profile (or load `profile_path`), predict each case, run it, compare; OUT/VALIDATION.md, results.json."""
    if warmup < 0 or steps <= warmup or runs < 1:
        raise GeotrainError("--steps must be larger than --warmup (and --warmup >= 0), --runs >= 1")
    profile = load_profile(profile_path) if profile_path else None
    _, md = run_validation(Path(out), quick=quick, profile=profile, steps=steps, warmup=warmup, only=cases,
                           modes=modes.split(","), runs=runs)
    say("")
    say(md)
    say(f"wrote {Path(out) / 'VALIDATION.md'} and results.json")


def validate_gpu(runs_dir: str, out: str, say=print) -> None:
    """Predict the published GPU runs in `runs_dir`; OUT/GPU_VALIDATION.md, gpu_results.json, per run its files."""
    out_dir = Path(out)
    result = validate_gpu_runs(load_gpu_runs(runs_dir), out_dir / "gpu_runs")
    md = gpu_markdown(result)
    (out_dir / "GPU_VALIDATION.md").write_text(md)
    (out_dir / "gpu_results.json").write_text(json.dumps(result.as_dict(), indent=1) + "\n")
    say(md)
    say(f"wrote {out_dir / 'GPU_VALIDATION.md'}, {out_dir / 'gpu_results.json'} and per run "
        f"{out_dir / 'gpu_runs'}/RUN/ "
        "(spec.toml, plan.json; `geotrain simulate RUN/plan.json --p2p blocking --profile "
        f"{out_dir / 'gpu_runs'}/profile-...json` repeats one)")
