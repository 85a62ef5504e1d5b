"""What a training run is asked to do (RunConfig), and its spec, plan and schedule resolved from it.

The launcher hands every rank the same RunConfig in a file (`runfile.py`); `resolve_run` turns it
into (spec, plan, schedule) and refuses, as one-line errors, what no rank could run.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from geotrain.costs.activations import SELECTIVE
from geotrain.errors import GeotrainError
from geotrain.layout.plan import Plan
from geotrain.layout.plan_check import check_plan_for_spec
from geotrain.planner.manual import plan_from_job
from geotrain.schedule.actions import Op
from geotrain.schedule.builders import schedule_for_plan
from geotrain.spec import load_spec, spec_from_document


@dataclass
class RunConfig:
    """What to run. JSON-serializable: the launcher hands it to every rank in a file."""

    spec: str                                   # experiment TOML (or the plan file spec_doc came from)
    spec_doc: dict[str, Any] | None = None      # the experiment itself (spec.document), as plan files carry it
    out: str = "runs/latest"
    plan: dict[str, Any] | None = None          # Plan.to_dict(); None: the plan the job pins
    overrides: dict[str, Any] = field(default_factory=dict)   # Plan fields to replace
    steps: int | None = None                    # None: job.steps
    resume: bool = False
    resume_from: str | None = None              # another run's RUN_DIR: start from its latest checkpoint, resharded
    checkpoint_every: int | None = None         # None: job.checkpoint_every
    data: str | None = None                     # None: job.data, then the built-in corpus
    progress: bool = True
    trace: bool = True
    # Test hooks, [[rank, step], ...] (steps 1-based); also settable by env GEOTRAIN_INJECT_INF /
    # GEOTRAIN_FAIL_AT = "rank:step,...". inject_inf puts an inf into one gradient of that rank
    # before the overflow check; fail_at raises on that rank at the start of that step.
    inject_inf: list[list[int]] = field(default_factory=list)
    fail_at: list[list[int]] = field(default_factory=list)
    # BubbleTea: prefill requests from the service at `address` run in this rank's bubbles
    # ({"address": [host, port], "inference_model": ..., ...}; see bubbletea.runtime_hook).
    bubbletea: dict[str, Any] | None = None
    # The WAN between the plan's DCs (set by the launcher, see runtime.cross_dc): {"mode": "kernel"|"shaper",
    # "rate_scale", "timeout_s", "hosts": {dc: address}}. None: gloo for every pair (no emulated WAN).
    wan: dict[str, Any] | None = None
    # DiLoCo (a plan with workers): which worker this job is and where the workers meet, set by the
    # launcher (runtime.diloco_setup): {"worker", "store": "host:port", "secret_file", "incarnation",
    # "dead_after_s", "bind"}. None: the plan has no workers.
    diloco: dict[str, Any] | None = None


def resolve(cfg: RunConfig):
    """(spec, plan) for a run config, with user errors as GeotrainError."""
    spec, plan, _ = resolve_run(cfg)
    return spec, plan


def resolve_run(cfg: RunConfig):
    """(spec, plan, schedule) for a run config, with user errors as GeotrainError: the schedule is built
    once here (it must be, to refuse what the builders refuse before any rank starts) and handed on to
    the rank's run and its summary."""
    spec = spec_from_document(cfg.spec_doc, cfg.spec) if cfg.spec_doc else load_spec(cfg.spec)
    plan = Plan.from_dict(cfg.plan) if cfg.plan else plan_from_job(spec)
    if cfg.overrides:
        plan = plan.with_(**cfg.overrides)
        if "checkpointing" in cfg.overrides:  # one mode for every stage, as asked
            plan = plan.with_(stages=tuple(replace(st, checkpointing=None) for st in plan.stages))

    check_plan_for_spec(spec, plan)    # a tampered or foreign plan is refused here, before any rank starts
    if plan.mixed_tp and getattr(spec.model, "tie_embeddings", False) and plan.pp > 1:
        raise GeotrainError(f"plan {plan.name!r}: tied embeddings with stages of different tp "
                            f"({plan.tp_label()}) are not supported (the first and last stage's copies are "
                            "summed TP index by TP index); pin job.tp")
    if max(plan.stage_tps) > 1 and plan.sharding == "zero1":
        raise GeotrainError(f"plan {plan.name!r}: sharding zero1 is not supported with tp={plan.tp_label()} "
                            "(use replicate, zero2 or zero3)")
    if plan.num_microbatches < 1 or plan.micro_batch < 1:
        raise GeotrainError("the plan needs at least one micro-batch of at least one sequence")
    schedule = schedule_for_plan(plan)  # a schedule the builders refuse is a user error, found before any rank starts
    selective = sorted({plan.stage_checkpointing(s) for s in range(plan.pp)} & set(SELECTIVE))
    if selective and _splits_backward(schedule):
        raise GeotrainError(f"plan {plan.name!r}: selective checkpointing cannot run under the {plan.schedule} "
                            f"schedule's split backward ({', '.join(selective)}: PyTorch allows one backward "
                            "through a selectively checkpointed region); use checkpointing full or none")
    return spec, plan, schedule


def _splits_backward(schedule) -> bool:
    """Whether the schedule runs a stage's backward as two autograd passes (input, then weights)."""
    return any(a.op == Op.BACKWARD_INPUT for actions in schedule.actions for a in actions)
