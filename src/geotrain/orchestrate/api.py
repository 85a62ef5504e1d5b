"""The Python API: what `geotrain.load_spec`, `plan`, `simulate` and `train` are (docs/API.md).

The same library functions the commands call, with keyword arguments instead of options:
`train(source, steps=3, wan="off")` builds the TrainConfig `geotrain train` would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from geotrain.layout.plan import Plan
from geotrain.orchestrate.spec_check import load_experiment
from geotrain.orchestrate.training_run import TrainResult
from geotrain.orchestrate.training_run import train as _train
from geotrain.planner.confirm import make_plan
from geotrain.planner.search import PlanResult
from geotrain.runtime.train_config import ResumeConfig, TrainConfig, WanConfig
from geotrain.sim import SimResult
from geotrain.sim import simulate as _simulate
from geotrain.spec import Spec, load_spec

__all__ = ["TrainConfig", "TrainResult", "load_spec", "plan", "simulate", "train"]


def plan(spec: Spec | str | Path, **options: Any) -> PlanResult:
    """The planner's choice for `spec` (`geotrain plan`): `.plan` is the Plan, `.iteration_s` its
    simulated iteration time. Options as `planner.confirm.make_plan` (top_k, objective, ...)."""
    return make_plan(spec if isinstance(spec, Spec) else load_experiment(spec), **options)


def simulate(spec: Spec | str | Path, plan: Plan | None = None, iterations: int = 1) -> SimResult:
    """Simulate `plan` (default: the planner's choice) on `spec`'s cluster: `.metrics`, `.trace`."""
    spec = spec if isinstance(spec, Spec) else load_experiment(spec)
    return _simulate(spec, plan if plan is not None else make_plan(spec).plan, iterations=iterations)


def train(source: Spec | str | Path, plan: Plan | None = None, *, wan: str | WanConfig = "off",
          resume: bool = False, resume_from: str | Path | None = None, overrides: dict | None = None,
          say=print, **config: Any) -> TrainResult:
    """Train for real on this machine, one process per rank (`geotrain train`): `source` a Spec, an
    experiment TOML or a plan file; `plan` the layout (default: the plan file's, else the planner's).
    `config`: TrainConfig fields (steps, out, data, progress, checkpoint_every, ...). Returns the run
    directory, the plan and the losses."""
    cfg = TrainConfig(wan=wan if isinstance(wan, WanConfig) else WanConfig(mode=wan),
                      resume=ResumeConfig(own=resume, from_run=str(resume_from) if resume_from else None), **config)
    return _train(source, cfg, plan=plan, overrides=overrides, say=say)
