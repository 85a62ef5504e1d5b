"""One rank's training run: build its stage from the plan, execute the schedule, record, checkpoint.

Called on every rank of an initialized process group (by `worker.py`, under our launcher or
torchrun). Ranks follow the plan's table (`plan.rank(stage, replica, t)`: stage-major, a region
plan pipeline-major; TP innermost), so the (pp, dp, tp) device mesh built from it has one DP group
per stage and TP index -- inside the stage's DC, or across a region plan's DCs -- and one TP group
of consecutive ranks (inside a node) per stage replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from geotrain.costs.activations import SELECTIVE
from geotrain.errors import GeotrainError
from geotrain.layout.plan import Plan
from geotrain.layout.tp_check import tp_problem
from geotrain.planner.manual import plan_from_job
from geotrain.runtime.rank_run import LossLog, RankRun, make_optimizer, state_bytes
from geotrain.schedule.actions import Op
from geotrain.schedule.builders import schedule_for_plan
from geotrain.spec import load_spec, spec_from_document

__all__ = ["FAILED_AT", "BubbleHookFactory", "RunConfig", "make_optimizer", "resolve", "resolve_run", "state_bytes",
           "train"]

# (conf, rank, recorder) -> an object with fill(...)/filling()/close(), or None; see PipelineRank's `bubble`.
BubbleHookFactory = Callable[[dict[str, Any], int, Any], Any]

# The attribute `train` sets on the exception a rank fails with: time.time() when it failed.
FAILED_AT = "geotrain_failed_at"


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

    problem = tp_problem(spec.model, plan, spec.cluster)
    if problem:
        raise GeotrainError(f"plan {plan.name!r}: {problem}")
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


def train(cfg: RunConfig, bubble_hook: BubbleHookFactory | None = None, resolved=None) -> dict[str, Any]:
    """Train on this rank (an initialized process group): a short loop over `rank_run.RankRun`'s
    named steps. Returns a small result dict (losses on the rank that owns them,
    `rank_run.report_rank`; {} elsewhere).

    `bubble_hook(conf, rank, recorder)` builds what runs in this rank's pipeline bubbles when
    `cfg.bubbletea` is set; the caller installs it (`orchestrate.rank_entry` installs BubbleTea's), so the
    runtime never imports what plugs into it. `resolved`: `resolve_run(cfg)` where the caller has it
    already (under torchrun the command resolved it in this process)."""
    spec, plan, schedule = resolved or resolve_run(cfg)
    run = RankRun(cfg, spec, plan, schedule, bubble_hook)
    start = run.resume()
    log = LossLog(run, start)
    run_start = time.time()
    try:
        for step in range(start + 1, run.steps + 1):
            run.fail_if_injected(step)
            seconds = run.train_step(step)
            log.record(step, seconds)
            run.checkpoint_if_due(step)
    except BaseException as e:
        # When this rank failed, stamped before closing its transport makes its peers fail in turn:
        # the launcher names the earliest failure (worker.write_error), and the peers' "closed its
        # transport" errors must not come out earlier than their cause.
        if not hasattr(e, FAILED_AT):
            setattr(e, FAILED_AT, time.time())
        run.close_transport()
        raise
    finally:
        run.close_hooks()
        log.close()
    return run.finish(wall=time.time() - run_start, losses=log.rows)
