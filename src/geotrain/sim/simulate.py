"""Entry points: simulate a plan from its costs (`layout.stage_costs`), or from explicit per-stage costs."""

from __future__ import annotations

from geotrain.errors import GeotrainError
from geotrain.layout.peaks import stage_peaks
from geotrain.layout.plan import Plan
from geotrain.layout.stage_costs import NormExchange, StageCost, StageCosts, plan_inputs
from geotrain.layout.wan_bytes import collective_bytes
from geotrain.schedule.actions import Schedule
from geotrain.schedule.builders import schedule_for_plan
from geotrain.schedule.deepspeed import deepspeed_1f1b
from geotrain.sim.columns import SimTrace
from geotrain.sim.cores import CorePool
from geotrain.sim.engine import run_engine
from geotrain.sim.outer import simulate_outer
from geotrain.sim.program import compile_program
from geotrain.sim.symmetry import replicas_alike, run_one_replica
from geotrain.spec import Cluster
from geotrain.trace.metrics import KIND_CODE, WAN_COLLECTIVE_BYTES, Metrics, compute_metrics
from geotrain.trace.schema import TRAINING_COMPUTE_KINDS

P2P_MODES = ("overlapped", "blocking")
_TRAINING_CODES = frozenset(KIND_CODE[k] for k in TRAINING_COMPUTE_KINDS)
_OPTIMIZER_CODE = KIND_CODE["optimizer"]

__all__ = ["SimResult", "StageCost", "plan_schedule", "simulate", "simulate_costs"]


class SimResult:
    """A simulation: its trace, schedule and plan; `iteration_time` straight from the engine's
    clocks, `metrics` (bubbles, link use, ... over the whole trace's columns) built when first
    read -- the planner simulates several finalists and needs the full metrics of one."""

    def __init__(self, trace: SimTrace, schedule: Schedule, plan: Plan, iteration_time: float | None,
                 tokens_per_iteration: int, peak_memory: dict[int, float] | None):
        self.trace, self.schedule, self.plan = trace, schedule, plan
        self._iteration_time = iteration_time
        self._tokens = tokens_per_iteration
        self._peak = peak_memory
        self._metrics: Metrics | None = None

    @property
    def metrics(self) -> Metrics:
        if self._metrics is None:
            self._metrics = compute_metrics(self.trace, self._tokens, self._peak)
        return self._metrics

    @property
    def iteration_time(self) -> float:
        """The metrics' iteration time (same definition), without building the trace's columns."""
        if self._iteration_time is None:
            return self.metrics.iteration_time
        return self._iteration_time

    @property
    def tokens_per_s(self) -> float:
        t = self.iteration_time
        return self._tokens / t if t > 0 else float("inf")


def _iteration_time(prog, res, iterations: int) -> float | None:
    """Mean over iterations of (last optimizer end - first training compute start), the window of
    trace.metrics, read from the engine's per-slot start times; None when an iteration has no
    optimizer step (the metrics then use any event's end)."""
    dp = prog.dp
    w0 = [float("inf")] * iterations
    w1 = [-float("inf")] * iterations
    for s, p in enumerate(prog.stages):
        first: dict[int, int] = {}
        opt: list[tuple[int, int]] = []
        for slot, (k, it) in enumerate(zip(p.kind, p.iteration)):
            if k in _TRAINING_CODES and it not in first:
                first[it] = slot
            if k == _OPTIMIZER_CODE:
                opt.append((it, slot))
        starts = res.start[s * dp:s * dp + dp]
        for it, slot in first.items():   # a unit's clock never goes back: its first compute starts first
            w0[it] = min(w0[it], min(st[slot] for st in starts))
        ends = res.end[s * dp:s * dp + dp] if res.end is not None else None
        for it, slot in opt:
            if ends is not None:
                w1[it] = max(w1[it], max(en[slot] for en in ends))
            else:
                w1[it] = max(w1[it], max(st[slot] for st in starts) + p.dur[slot])
    if any(x == -float("inf") or y == float("inf") for x, y in zip(w1, w0)):
        return None
    return sum(b - a for a, b in zip(w0, w1)) / iterations


def plan_schedule(plan: Plan) -> Schedule:
    """The plan's schedule (see geotrain.schedule.builders.schedule_for_plan)."""
    return schedule_for_plan(plan)


def simulate_costs(plan: Plan, cluster: Cluster, stage_costs: list[StageCost], allreduce_time: list[float],
                   optimizer_time: list[float], tokens_per_iteration: int, iterations: int = 1,
                   schedule: Schedule | None = None, progress: bool = False,
                   peak_memory: dict[int, float] | None = None, core_slowdown: list[float] | None = None,
                   costs: StageCosts | None = None, p2p: str = "overlapped",
                   step_sync: list[float] | None = None, norm: NormExchange | None = None) -> SimResult:
    """The core: run `iterations` iterations of the plan's schedule with explicit costs.

    stage_costs: one per virtual stage; allreduce_time, optimizer_time: one per physical stage.
    peak_memory (per rank, bytes) is passed through to the metrics. costs: what prices the
    transfers (a calibrated StageCosts: measured latencies and ACK waits); None: the analytic one
    over `cluster`. core_slowdown: for a CPU-emulated run whose ranks
    outnumber the host's cores, how much slower each of k units computing at once runs
    ([unused, k=1, k=2, ...], sim.cores): compute then shares the cores (processor sharing);
    None (GPU runs, or a core per rank): each unit computes alone. p2p: how the runtime moves
    boundary tensors -- "overlapped" (geotrain's: a send does not wait for its receive) or
    "blocking" (DeepSpeed's pipe engine: blocking NCCL send/recv in its TrainSchedule's order,
    `schedule.deepspeed`; 1F1B plans inside one DC only). step_sync: per physical stage, the
    runtime's step-wide collective before its optimizer step, as a wait a calibration measured
    (calibrate.waits). norm: the gradient norm's exchange before each optimizer step, modelled
    (clipping on, bf16/fp32: `StageCosts.norm_exchange`; the analytic prediction's)."""
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    if p2p not in P2P_MODES:
        raise ValueError(f"unknown p2p mode {p2p!r} (known: {', '.join(P2P_MODES)})")
    if p2p == "blocking":
        if plan.schedule != "1f1b" or plan.virtual_per_stage != 1:
            raise GeotrainError(f"blocking P2P is DeepSpeed's 1F1B: plan {plan.name} runs {plan.schedule}")
        sched = deepspeed_1f1b(plan.pp, plan.num_microbatches)
    else:
        sched = schedule if schedule is not None else plan_schedule(plan)
    costs = costs if costs is not None else StageCosts(None, cluster)
    prog = compile_program(plan, costs, sched, stage_costs, allreduce_time, optimizer_time, iterations,
                           blocking=p2p == "blocking", step_sync=step_sync, norm=norm)
    offsets = list(plan.pipeline_offsets) + [0.0] * (plan.dp - len(plan.pipeline_offsets))
    offsets = offsets[:plan.dp]
    pool = CorePool(core_slowdown) if core_slowdown is not None else None
    # Replicas competing for cores are not alike: with a pool every unit is simulated.
    alike = pool is None and replicas_alike(prog, offsets)
    res = run_one_replica(prog, offsets, progress=progress) if alike else \
        run_engine(prog, offsets, progress=progress, cores=pool)
    meta = {"plan": plan.name, "schedule": sched.kind, "iterations": iterations, "pp": plan.pp, "dp": plan.dp,
            "tp": plan.tp, **({"stage_tp": list(plan.stage_tps)} if plan.mixed_tp else {}),
            "num_microbatches": plan.num_microbatches, "tokens_per_iteration": tokens_per_iteration,
            "links": prog.link_meta, "engine": {"actions": res.actions, "wan_events": res.wan_events,
                                                "wall_s": res.wall_s, "replicas_simulated": 1 if alike else plan.dp}}
    fast = _iteration_time(prog, res, iterations)
    trace = SimTrace(prog, res, plan.rank_table, plan.num_ranks, meta)
    return SimResult(trace, sched, plan, fast, tokens_per_iteration, peak_memory)


def norm_exchange(spec, plan: Plan, costs: StageCosts) -> NormExchange | None:
    """The gradient norm's exchange a run of `spec` pays per step: clipping on, and not fp16 (which
    folds the norm into its overflow all-reduce)."""
    if spec.job.grad_clip <= 0 or plan.precision == "fp16":
        return None
    return costs.norm_exchange(plan)


def simulate(spec, plan: Plan, iterations: int = 1, cost=None, progress: bool = False,
             costs: StageCosts | None = None, p2p: str = "overlapped") -> SimResult:
    """Simulate `plan` on `spec.cluster` with times and bytes from `costs` (`layout.stage_costs`:
    default the analytic ones from the cost model, `cost` when given): per virtual stage its compute
    with the TP all-reduces, per physical stage its DP sync (every collective FSDP2 runs, the tied
    embedding's gradient sum) and optimizer step; per rank peak memory as `layout.peaks.stage_peaks`
    predicts it. Boundary copies (one per receiving TP rank) are counted by program.py. p2p: see
    `simulate_costs` ("blocking": a DeepSpeed run's pipe engine)."""
    if plan.outer is not None:      # DiLoCo: the workers' inner steps and the exchanges between them
        def one(s, p, n):
            return simulate(s, p, n, cost, progress, costs, p2p)
        return simulate_outer(spec, plan, iterations, one, costs, cost)
    if costs is None:
        costs = StageCosts.for_plan(spec, plan, cost)
    sched = plan_schedule(plan)
    inputs = plan_inputs(costs, plan)
    peak_memory = {}
    peaks = stage_peaks(spec, plan, sched, costs.base)  # as the runtime's prediction: chunks weighed, B-W counted
    for s in range(plan.pp):
        peak_memory.update(dict.fromkeys(plan.stage_ranks(s), peaks[s][0].total))
    tokens = plan.global_batch * spec.model.seq_len
    res = simulate_costs(plan, costs.cluster, inputs.stage_costs, inputs.allreduce, inputs.optimizer, tokens,
                         iterations=iterations, schedule=sched, progress=progress, peak_memory=peak_memory,
                         costs=costs, p2p=p2p, norm=norm_exchange(spec, plan, costs))
    # The trace moves no bytes for the collectives: their WAN bytes come from the one definition
    # (layout.wan_bytes), which trace.metrics adds to the transfers' bytes.
    res.trace.meta[WAN_COLLECTIVE_BYTES] = sum(collective_bytes(spec, plan).values())
    return res
