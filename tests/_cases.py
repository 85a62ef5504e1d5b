"""RunCases for the runtime tests: the experiment, a plan (default: the layout the job pins) with
plan fields overridden, and a TrainConfig -- what `geotrain train` hands every rank."""

from __future__ import annotations

from pathlib import Path

from geotrain.layout.plan import Plan
from geotrain.orchestrate.training_run import load_case
from geotrain.planner.manual import plan_from_job
from geotrain.runtime.train_config import ResumeConfig, RunCase, TestHooks, TrainConfig
from geotrain.spec import Spec, load_spec


def case(spec: str | Path | Spec, out: str | Path = "runs/test", plan: Plan | None = None,
         overrides: dict | None = None, resume: bool = False, resume_from: str | Path | None = None,
         inject_inf=(), fail_at=(), **config) -> RunCase:
    """`config`: TrainConfig fields (steps, data, progress, checkpoint_every, trace, wan...)."""
    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    config.setdefault("hooks", TestHooks(inject_inf=list(inject_inf), fail_at=list(fail_at)))
    cfg = TrainConfig(out=str(out), resume=ResumeConfig(own=resume, from_run=str(resume_from) if resume_from else None),
                      **config)
    return load_case(spec, cfg, plan or plan_from_job(spec), overrides)
