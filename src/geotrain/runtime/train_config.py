"""What a training run is asked to do (TrainConfig), and one run as every rank executes it (RunCase).

`TrainConfig` is built once, by whoever starts the run (`geotrain train`, `geotrain.train(...)`,
a test), and travels unchanged to every rank in the run file (`runfile.py`) -- no environment
variables, no untyped dicts. Its parts: `wan` (the WAN between the plan's DCs), `serve` (BubbleTea
prefill in the bubbles), `resume`, `elastic` (re-plan on a lost DC; the launcher's), `diloco` (a
DiLoCo worker's meeting point), `hooks` (fault injection for tests). The launcher fills in what only
it knows (the emulated DCs' addresses, the prefill service's socket, the workers' store) before
writing the file.

A `RunCase` is (spec, plan, config): the plan is final -- the one a rank runs, chosen and checked
before any rank starts; ranks never plan. `RunCase.schedule` checks, once, what no rank could run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from geotrain.console import number_runs
from geotrain.costs.activations import SELECTIVE
from geotrain.errors import GeotrainError
from geotrain.layout.plan import Plan
from geotrain.layout.plan_check import check_plan_for_spec
from geotrain.schedule.actions import Op, Schedule
from geotrain.schedule.builders import schedule_for_plan
from geotrain.spec import Spec

WAN_MODES = ("auto", "kernel", "shaper", "direct", "off")
DEFAULT_OUTAGE_LIMIT_S = 300.0      # how long a cross-DC wait may last before its rank fails, unless asked


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WanConfig(_Part):
    """The WAN between the plan's DCs (runtime.cross_dc). Asked for: auto (kernel where possible, else
    shaper; under torchrun: direct), kernel (emulated DCs in network namespaces), shaper (delay and
    rates inside our transport), direct (the real network, under torchrun), off (plain gloo/NCCL).
    The launcher narrows `auto` to what runs before the ranks see it."""

    mode: Literal["auto", "kernel", "shaper", "direct", "off"] = "off"
    rate_scale: PositiveFloat = 1.0          # multiplies every WAN capacity and per-connection cap
    tls: bool = False                        # cross-DC connections in TLS 1.3 keyed by the run secret
    bind: str | None = None                  # direct/shaper: this host's transport address
    timeout_s: PositiveFloat | None = None   # how long a cross-DC transfer may wait (None: the transport's)
    stall_s: PositiveFloat | None = None     # a transfer without progress this long is reported while it waits
    hosts: dict[str, str] = {}               # kernel: each DC's address (filled by the launcher)

    @property
    def outage_limit_s(self) -> float:
        """How long any cross-DC wait (a transfer, a peer's address, the gradient norm) may last."""
        return self.timeout_s or DEFAULT_OUTAGE_LIMIT_S


class ServeConfig(_Part):
    """BubbleTea: serve prefill requests and run them in the ranks' pipeline bubbles."""

    port: NonNegativeInt = 0                 # 127.0.0.1:PORT (0: any free port)
    model: str = "tiny"                      # a preset, an HF directory, or a training run's directory
    priority: Literal["auto", "idle", "normal"] = "auto"
    duty: NonNegativeInt = 0                 # alternate N steps without prefill and N with it (0: always on)
    token: str | None = Field(default=None, exclude=True)    # the API's bearer token: never written to a file
    address: str | list[Any] | None = None   # the executor's socket (filled by the launcher)
    secret_file: str | None = None           # the executor's 0600 secret (filled by the launcher)


class ResumeConfig(_Part):
    own: bool = False                        # continue this run's latest checkpoint (--resume)
    from_run: str | None = None              # another run's directory: its latest checkpoint, resharded

    @model_validator(mode="after")
    def _one(self) -> ResumeConfig:
        if self.own and self.from_run:
            raise ValueError("give --resume (this run's own checkpoint) or --resume-from, not both")
        return self

    @property
    def any(self) -> bool:
        return self.own or bool(self.from_run)


class ElasticConfig(_Part):
    """Re-plan without a DC whose ranks die, and resume on the rest (the built-in launcher's)."""

    enabled: bool = False
    cut_dc: str | None = None                # rehearsal: "DC:STEP", kill DC's ranks once STEP is logged
    cut_link: str | None = None              # rehearsal: "DC:STEP", take DC's WAN interface down

    @model_validator(mode="after")
    def _one(self) -> ElasticConfig:
        if self.cut_dc and self.cut_link:
            raise ValueError("rehearse one failure at a time: --cut-dc or --cut-link")
        return self


class DilocoConfig(_Part):
    """Where a DiLoCo plan's workers meet (filled by the launcher, runtime.diloco_launch)."""

    worker: NonNegativeInt = 0               # which worker this job is
    store: str | None = None                 # the outer store's "host:port"
    secret_file: str | None = None           # the 0600 secret keying the outer transport
    incarnation: NonNegativeInt = 0
    dead_after_s: PositiveFloat | None = None   # a worker whose heartbeat stops this long is dropped
    rejoin_wait_s: float = Field(0.0, ge=0)  # elastic: how long an exchange waits for a restarted worker
    bind: str | None = None                  # the outer transport's address (default: the WAN's)


class TestHooks(_Part):
    """Fault injection for tests, steps 1-based: `inject_inf` (rank, step) puts an inf into one gradient
    of that rank before the overflow check; `fail_at` (rank, step[, DiLoCo worker]) raises there at the
    step's start; `case_marks` (a directory): before each case of a launch, and after the last, rank 0
    writes ready<i> there and waits for go<i> (a test reading counters while nothing moves)."""

    __test__ = False          # not a pytest class
    inject_inf: list[tuple[int, int]] = []
    fail_at: list[tuple[int, int] | tuple[int, int, int]] = []
    case_marks: str | None = None

    def steps(self, kind: str, rank: int) -> set[int]:
        return {x[1] for x in getattr(self, kind) if x[0] == rank}

    def for_worker(self, w: int) -> TestHooks:
        """The hooks of DiLoCo worker `w`: fail_at entries naming another worker left out."""
        return self.model_copy(update={"fail_at": [x[:2] for x in self.fail_at if len(x) < 3 or x[2] == w]})


class TrainConfig(_Part):
    """What to do with a plan; see the module docstring."""

    out: str | None = None                   # the run directory (None: runs/<experiment>, see RunCase)
    steps: PositiveInt | None = None         # None: job.steps
    checkpoint_every: NonNegativeInt | None = None   # None: job.checkpoint_every; 0: never
    data: str | None = None                  # None: job.data, then the built-in corpus; "synthetic"
    progress: bool = True
    trace: bool = True
    resume: ResumeConfig = ResumeConfig()
    wan: WanConfig = WanConfig()
    serve: ServeConfig | None = None
    elastic: ElasticConfig = ElasticConfig()
    profile: str | None = None               # predict beside the run with this profile (calibrated simulation)
    dc: str | None = None                    # under torchrun: the DC this host is in (checked against the plan)
    collective_timeout_s: PositiveFloat = 600.0    # the process group's timeout
    diloco: DilocoConfig | None = None       # a DiLoCo plan's worker (None: the plan has no workers)
    hooks: TestHooks = TestHooks()

    def with_(self, **changes) -> TrainConfig:
        """A copy with `changes` (nested parts given whole), validated."""
        return TrainConfig.model_validate({**self.model_dump(), **{k: _dump(v) for k, v in changes.items()}})

    def run_steps(self, spec: Spec) -> int:
        return self.steps or spec.job.steps

    def saving_every(self, spec: Spec) -> int:
        return spec.job.checkpoint_every if self.checkpoint_every is None else self.checkpoint_every


def _dump(v):
    return v.model_dump() if isinstance(v, BaseModel) else v


@dataclass(frozen=True)
class RunCase:
    """One run as every rank executes it: the experiment, the plan (final), what to do."""

    spec: Spec
    plan: Plan
    config: TrainConfig

    def __post_init__(self) -> None:
        if self.config.out is None:
            raise ValueError("a RunCase needs its run directory (config.out)")

    @cached_property
    def schedule(self) -> Schedule:
        """The plan's schedule, after refusing (one-line GeotrainError) what no rank could run."""
        return runnable_schedule(self.spec, self.plan)


def runnable_schedule(spec: Spec, plan: Plan) -> Schedule:
    """The schedule `plan` runs, or a GeotrainError for a plan the runtime cannot run."""
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
    schedule = schedule_for_plan(plan)   # a shape the builders refuse: a ScheduleError (a GeotrainError)
    selective = sorted({plan.stage_checkpointing(s) for s in range(plan.pp)} & set(SELECTIVE))
    if selective and any(a.op == Op.BACKWARD_INPUT for actions in schedule.actions for a in actions):
        raise GeotrainError(f"plan {plan.name!r}: selective checkpointing cannot run under the {plan.schedule} "
                            f"schedule's split backward ({', '.join(selective)}: PyTorch allows one backward "
                            "through a selectively checkpointed region); use checkpointing full or none")
    return schedule


def check_host_dc(plan, rank: int, dc: str) -> None:
    """--dc under torchrun: the plan must put this RANK in this host's datacenter. torchrun numbers the
    hosts: static rendezvous (--master-addr) by each host's --node-rank; c10d rendezvous ignores
    --node-rank and sorts the hosts by --local-addr, as text -- neither need follow the plan."""
    dcs = plan.dcs_by_rank()
    if dc not in dcs:
        raise GeotrainError(f"--dc {dc}: the plan uses no such datacenter ({', '.join(dcs)})")
    if rank >= plan.num_ranks:
        return                          # the world-size check names this one
    mine = plan.dc_of_rank(rank)
    if mine != dc:
        s, d, _ = plan.coords(rank)
        order = " -> ".join(f"{x} ranks {number_runs(plan.ranks_of_dc(x))}" for x in dcs)
        raise GeotrainError(f"--dc {dc}: rank {rank} is stage {s} in {mine} by the plan (DP pipeline {d}); the hosts "
                            f"must be numbered in the plan's datacenter order ({order}): with static rendezvous "
                            f"(--master-addr) give each host its --node-rank in that order ({dc} is "
                            f"{dcs.index(dc)}); with c10d rendezvous --node-rank is ignored and hosts are numbered "
                            "by their --local-addr sorted as text -- use static rendezvous, or addresses that sort "
                            "in the plan's order")


def report_rank(plan) -> int:
    """The rank that owns the loss: the last stage's first replica (TP index 0)."""
    return plan.rank(plan.pp - 1, 0, 0)
