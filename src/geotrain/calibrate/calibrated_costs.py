"""Calibrated simulation: `CalibratedCosts`, the analytic StageCosts (layout.stage_costs) with what a
measured profile knows in place of the cost model's estimates.

It adds what the plain cost model leaves out, each from a number in the profile's runtime part:
the runtime's compute factors and per-action interpreter time, the measured DP all-reduce with its
in-run factor, the optimizer step, p2p and per-message WAN overhead (calibrated_links), the ACK
wait and the step-wide collective before each optimizer step, and CPU contention -- the
simulator's core pool where ranks outnumber cores (`core_slowdown`), else a fixed point of
averages. docs/VALIDATION.md ("What the calibrated simulation models") says what each term is,
how it is measured and why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from geotrain.calibrate.calibrated_links import calibrated_cluster, slowdown
from geotrain.calibrate.profile_file import MeasuredProfile, RuntimeProfile
from geotrain.calibrate.waits import ack_delays, global_sync_s, norm_exchange
from geotrain.costs import CostModel, StageTimes, comm
from geotrain.costs.memory import fsdp_gather_bytes_per_param
from geotrain.layout.stage_costs import NormExchange, StageCosts, plan_inputs
from geotrain.layout.wan_bytes import collective_bytes
from geotrain.schedule.actions import Op
from geotrain.sim import simulate_costs
from geotrain.sim.simulate import plan_schedule
from geotrain.trace.metrics import WAN_COLLECTIVE_BYTES, trace_columns
from geotrain.trace.schema import TRAINING_COMPUTE_KINDS

CONTENTION_ROUNDS = 3


@dataclass
class CalibratedInputs:
    cluster: Any
    stage_costs: list            # geotrain.sim.StageCost per virtual stage
    allreduce: list[float]       # per physical stage (the tied sum included)
    optimizer: list[float]       # per physical stage: the step itself (CPU work)
    tokens: int
    global_sync: float = 0.0     # the step-wide collective before each step (waiting, not CPU): waits.py
    ack_s: dict[str, float] | None = None   # per WAN direction: last byte out -> ACK at the sender (None: RTT)
    costs: CalibratedCosts | None = None    # what priced them (the simulator's transfers too)
    norm: NormExchange | None = None        # clipping's norm exchange (bf16/fp32), as messages: waits.py


def core_slowdown(spec, plan, profile: MeasuredProfile | dict, background: float,
                  residual: float) -> list[float] | None:
    """The simulator's core pool table [unused, k=1, ..., k=units] for a CPU-emulated run whose ranks
    outnumber the host's cores: k units (tp ranks each) computing at once beside `background`
    runnable threads each run residual x max(1, (k x tp + background) / cores) slower (processor
    sharing, sim.cores says why). None when each rank has its own core or GPU: the pool is off.
    Both sides are known before the run: the plan's ranks (all on this host under the emulation)
    and the profile's `cores` (os.sched_getaffinity when it was taken)."""
    rt = MeasuredProfile.of(profile).runtime
    ncores, threads = rt.cores, max(1, rt.threads)
    cpu = all(spec.cluster.dc(st.dc).gpu_type == "cpu" for st in plan.stages)
    if not cpu or ncores < 1 or plan.num_ranks * threads <= ncores:
        return None
    units = plan.pp * plan.dp
    return [1.0] + [residual * slowdown(k * plan.tp * threads, background, ncores) for k in range(1, units + 1)]


def profile_mode(profile: MeasuredProfile | dict) -> str:
    """The WAN mode the profile's calibration run used ("shaper" for profiles made before modes)."""
    return MeasuredProfile.of(profile).runtime.calibration_run.wan_mode


def fsdp_gather_s(plan, cost, units: range, rt: RuntimeProfile) -> tuple[float, float]:
    """(per forward, per backward) seconds of FSDP2 parameter all-gathers inside one micro-batch's
    compute (runtime.parallelize.apply_fsdp: one group per block plus the chunk's root). How many
    per iteration is costs.comm.fsdp_gathers: zero3 frees the gathered weights after each forward
    and a backward keeps them, so m+1 (spread evenly over the m forwards and m backwards); zero2
    once (spread over the forwards); replicate and zero1 gather nothing. The bytes are FSDP2's
    param dtype (costs.memory.fsdp_gather_bytes_per_param: bf16 under bf16, else fp32). One
    all-gather of B bytes over the DP group costs the measured gloo all-reduce fit at B / 2 (an
    all-gather moves half of what an all-reduce does)."""
    if plan.sharding not in ("zero2", "zero3") or plan.dp <= 1:
        return 0.0, 0.0
    fit = rt.allreduce.get(str(plan.dp))
    if not fit:
        return 0.0, 0.0
    blocks = [u for u in units if 0 < u <= cost.model.layers]
    root = [u for u in units if u not in blocks]
    groups = [[u] for u in blocks] + ([root] if root else [])
    param_bytes = fsdp_gather_bytes_per_param(cost.precision)
    gather = sum(fit.alpha_s + param_bytes * cost.stage_params(g) * fit.per_byte_s / 2 for g in groups)
    m = max(1, plan.num_microbatches)
    gathers = comm.fsdp_gathers(plan.sharding, m) * gather
    if plan.sharding == "zero3":
        return gathers / (2 * m), gathers / (2 * m)
    return gathers / m, 0.0


class CalibratedCosts(StageCosts):
    """The analytic costs (layout.stage_costs) of one plan with what the profile measures in their
    place (see the module docstring): per-unit times through the cost model's profile, the
    runtime's compute factors, per-action overhead, FSDP gathers and backward split (`stage_compute`),
    the fitted DP all-reduce (`stage_sync`), the optimizer step, the measured p2p and per-message
    WAN overhead (its cluster) and the ACK wait (`wan`). TP all-reduces, the tied embedding's sum,
    boundary bytes and the turn rule are the analytic ones."""

    def __init__(self, spec, plan, profile: MeasuredProfile | dict, background: float | None = None,
                 mode: str | None = None, message_scale: float | None = None):
        profile = MeasuredProfile.of(profile)
        self.rt = rt = profile.runtime
        cost = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing,
                         optimizer=spec.job.optimizer, profile=profile.cost_tables(), ep=plan.ep)
        self.mode = mode or profile_mode(profile)
        boundary = cost.boundary_bytes(plan.micro_batch)   # what the runtime sends: the training dtype
        super().__init__(cost, calibrated_cluster(spec, profile, background, self.mode, boundary, message_scale, plan))
        self.ack = ack_delays(spec, self.cluster, self.mode)
        self.global_sync = global_sync_s(spec, plan, profile, self.mode)
        self.norm = norm_exchange(spec, plan, profile, self.mode)
        # Interpreter time per compute action: its own plus its share of the stage's non-compute actions.
        per_action = rt.per_action_s
        compute_ops = {Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT}
        self.share = [per_action * len(acts) / max(1, sum(1 for a in acts if a.op in compute_ops))
                      for acts in plan_schedule(plan).actions]

    def stage_compute(self, plan, v: int) -> StageTimes:
        t = super().stage_compute(plan, v)       # the profile's per-unit times
        factor, split = self.rt.compute_factor, self.rt.split_backward
        a, b = plan.virtual_units()[v]
        o = self.share[v % plan.pp]
        ff, fb = factor.forward, factor.backward
        g_fwd, g_bwd = fsdp_gather_s(plan, self.base, range(a, b), self.rt)
        b_in, b_w = t.backward_input, t.backward_weight
        if split:       # measured zero-bubble split (profile.time_split_backward)
            b_in, b_w = t.backward * split.input, t.backward * split.weight
        b_in += g_bwd   # FSDP re-gathers at the first backward pass
        if v == 0:      # the runtime defers the first stage's whole backward to W (no input gradient to send)
            b_in, b_w = 0.0, t.backward + g_bwd
        return StageTimes(forward=(t.forward + g_fwd) * ff + o, backward=(t.backward + g_bwd) * fb + o,
                          backward_input=b_in * fb + o / 2, backward_weight=b_w * fb + o / 2)

    def stage_sync(self, plan, s: int, spread=None) -> float:
        """The measured gloo all-reduce fit at the plan's dp, times its in-run factor; FSDP2's
        gathers are in the compute (fsdp_gather_s), so this is the reduction. Without a fit at
        that dp, the analytic sync."""
        fit = self.rt.allreduce.get(str(plan.dp))
        if plan.dp <= 1 or not fit:
            return super().stage_sync(plan, s, spread)
        f = self.rt.compute_factor.allreduce_at(s)
        # replicated DP reduces in the training dtype (runtime.parallelize.allreduce_grads)
        params = self.base.stage_params(plan.stages[s].units)
        return (fit.alpha_s + self.base.dtype_bytes * params * fit.per_byte_s) * f

    def stage_optimizer(self, plan, s: int) -> float:
        opt = self.rt.optimizer
        if not opt:
            return super().stage_optimizer(plan, s)
        params = self.base.stage_params(plan.stages[s].units)
        return (opt.fixed_s + params * opt.per_param_s) * self.rt.compute_factor.optimizer

    def wan(self, a: str, b: str, connections: int, sharing: str, pipelines: int, copies: int = 1):
        w = super().wan(a, b, connections, sharing, pipelines, copies)
        if w is None or self.ack is None:
            return w
        return replace(w, ack_s=self.ack.get(f"{a}->{b}", w.ack_s))


def calibrated_inputs(spec, plan, profile: MeasuredProfile | dict, background: float | None = None,
                      mode: str | None = None, message_scale: float | None = None) -> CalibratedInputs:
    """Per-stage costs for `geotrain.sim.simulate_costs`, before contention (see module docstring)."""
    costs = CalibratedCosts(spec, plan, profile, background, mode, message_scale)
    inp = plan_inputs(costs, plan)
    return CalibratedInputs(costs.cluster, inp.stage_costs, inp.allreduce, inp.optimizer,
                            plan.global_batch * spec.model.seq_len, costs.global_sync, costs.ack, costs, costs.norm)


def compute_concurrency(result, plan) -> list[float]:
    """Per physical stage: the time-averaged number of ranks computing while its ranks compute."""
    cols = trace_columns(result.trace)
    m = cols.kind_mask(TRAINING_COMPUTE_KINDS)
    rank, s, e = cols.rank[m], cols.start[m], cols.end[m]
    # Sweep: +1 at each start, -1 at each end; level between consecutive points.
    pts = np.concatenate([s, e])
    delta = np.concatenate([np.ones(len(s)), -np.ones(len(e))])
    order = np.lexsort((delta, pts))        # ends before starts at equal times
    pts, level = pts[order], np.cumsum(delta[order])
    out = []
    for stage in range(plan.pp):
        ranks = [plan.rank(stage, d) for d in range(plan.dp)]
        sel = np.isin(rank, ranks)
        total, weighted = 0.0, 0.0
        for a, b in zip(s[sel], e[sel]):
            if b <= a:
                continue
            i0, i1 = np.searchsorted(pts, a, "right"), np.searchsorted(pts, b, "left")
            edges = np.concatenate([[a], pts[i0:i1], [b]])
            lv = np.concatenate([[level[i0 - 1]], level[i0:i1]])
            weighted += float(np.sum(np.diff(edges) * lv))
            total += b - a
        out.append(weighted / total if total > 0 else 1.0)
    return out


def predict(spec, plan, profile: MeasuredProfile | dict, iterations: int = 3, contention: bool = True,
            background: float | None = None, mode: str | None = None,
            rank_slowdown: dict[int, float] | None = None):
    """Simulate `plan` with the calibrated inputs; returns (SimResult, details dict).

    background: other threads ready to run on the machine while the plan runs, on average
    (cpuload.CpuSampler.background_runnable); None: the background the profile's calibration run
    had, as the processor-sharing model reads its measured CPU shares (profile_file.py).
    mode: the runtime's WAN mode of the run predicted ("shaper", "kernel", "off"); None: the
    profile's calibration run's.
    rank_slowdown: {rank: CPU-sharing slow-down measured while the run trained} (wanrun.run_plan,
    from the kernel's per-thread run-queue wait): when given, each stage's compute is scaled by its
    ranks' mean instead of the processor-sharing model -- for runs on a machine whose other load
    is too bursty to model from a sample of runnable threads."""

    profile = MeasuredProfile.of(profile)
    rt, cal = profile.runtime, profile.runtime.calibration_run
    mode = mode or cal.wan_mode
    # Measured CPU sharing: the message hand-offs slow down like the ranks' main threads did,
    # relative to the calibration run (the processor-sharing model of a bursty sampled background
    # read 6x at a background of 11 threads where the ranks measured 1.3-1.5x).
    msg_scale = None
    cal_slow = cal.rank_slowdown.values()
    if rank_slowdown and contention and cal_slow:
        msg_scale = (sum(rank_slowdown.values()) / len(rank_slowdown)) / (sum(cal_slow) / len(cal_slow))
    inp = calibrated_inputs(spec, plan, profile, background, mode, msg_scale)
    # Default: the conditions of the calibration run, which the compute factors were measured under.
    # Profiles with `sharing_residual`: processor sharing at the calibration run's sampled background,
    # times what its ranks lost beyond that. (The older additive "effective background" put that
    # loss into phantom runnable threads, which over-charged every plan that keeps both cores
    # busy: +27 % on the 2 ms link, quiet machine.)
    residual = (cal.sharing_residual or 1.0) if background is None else 1.0
    if background is None and cal.sharing_residual is not None:
        bg = cal.background_runnable or 0.0
        # Where the sampled count over-states what the calibration run's ranks measured (the
        # residual would be < 1: a load burst of many threads in few sessions, which the autogroup
        # scheduler shares by -- 20.8 runnable threads once, where the ranks' measured slow-down
        # read as 0.76), the background that reproduces their measured CPU share instead.
        if cal.background_effective is not None:
            bg = min(bg, cal.background_effective)
    else:
        bg = next(x for x in (cal.background_effective, cal.background_runnable, rt.background_runnable)
                  if x is not None) if background is None else background
    factors = [1.0] * plan.pp
    res = None
    measured = bool(rank_slowdown) and contention
    # A dp >= 2 plan whose ranks outnumber the cores: what the profile's own dp = 2 run computed beyond
    # the pool's prediction (calibration_run.allreduce_factor_run says why), under the same conditions.
    # (The calibration run's own when the profiled job has dp >= 2, else its dp = 2 run's.)
    pool_residual = next(x for x in (cal.pool_residual, cal.allreduce_run.get("pool_residual"), 1.0)
                         if x is not None) if background is None and plan.dp >= 2 else 1.0
    ncores = rt.cores or 1
    pool = core_slowdown(spec, plan, profile, bg, residual * pool_residual) if contention and not measured else None
    if measured:
        factors = [sum(rank_slowdown.get(plan.rank(st, d), 1.0) for d in range(plan.dp)) / plan.dp
                   for st in range(plan.pp)]
    for _ in range(1 if measured or not contention or pool is not None else CONTENTION_ROUNDS):
        costs = [replace(c, forward=c.forward * factors[v % plan.pp], backward=c.backward * factors[v % plan.pp],
                         backward_input=c.backward_input * factors[v % plan.pp],
                         backward_weight=c.backward_weight * factors[v % plan.pp])
                 for v, c in enumerate(inp.stage_costs)]
        # The simulator has no global barrier: the step-wide collective is a wait before each stage's
        # step (the run records it as recv_wait), unscaled by CPU sharing.
        opt = [t * f for t, f in zip(inp.optimizer, factors)]
        res = simulate_costs(plan, inp.cluster, costs, inp.allreduce, opt, inp.tokens, iterations=iterations,
                             core_slowdown=pool, costs=inp.costs, step_sync=[inp.global_sync] * plan.pp,
                             norm=inp.norm)
        if not contention or measured or pool is not None:
            break
        conc = compute_concurrency(res, plan)
        factors = [residual * slowdown(k, bg, ncores) for k in conc]
    res.trace.meta[WAN_COLLECTIVE_BYTES] = sum(collective_bytes(spec, plan).values())   # as sim.simulate does
    return res, {"contention_factors": factors, "contention_measured": measured, "background_runnable": bg,
                 "core_pool": pool,
                 "compute_concurrency": compute_concurrency(res, plan), "allreduce_s": inp.allreduce,
                 "optimizer_s": inp.optimizer, "wan_mode": mode,
                 "global_sync_s": inp.global_sync}
