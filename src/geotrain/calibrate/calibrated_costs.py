"""Calibrated simulation: the simulator's inputs built from a measured profile, with the effects the
plain cost model leaves out modelled explicitly.

What is modelled (each from a number in the profile's "runtime" part, see profile.py):
  * compute per virtual stage: the sum of its units' measured forward/backward (CostModel with the
    profile) times the runtime factor of that kind (`compute_factor`, from the profile's real
    2-stage calibration run: what running inside the runtime beside another rank adds), plus the
    interpreter's own time around each compute action (`per_action_s` for the compute action and
    the receive/send actions that come with it); zero-bubble B_input / W as the measured split of
    the runtime's two autograd passes (the first stage's whole backward at W); FSDP zero2/zero3
    parameter all-gathers inside forward/backward (`fsdp_gather_s`);
  * the DP reduction: the measured gloo all-reduce fit alpha + bytes x per_byte at that dp, on the
    gradients the runtime reduces (replicated DP: in the training dtype), times the calibration run's in-run factor
    for it (`compute_factor["allreduce"]`: that run's when it had dp > 1, else a dp = 2 run of its
    own, `calibration_run.allreduce_factor_run`; the first stage's and the other stages' apart,
    "allreduce_first_stage" / "allreduce_other_stages", where the profile has them);
  * the optimizer step: measured fixed + per-parameter cost;
  * intra-DC point-to-point: the cluster's intra-DC latency and bandwidth replaced by the measured
    gloo isend/irecv fit;
  * WAN messages: the user-space WAN hands each message through several threads (dispatcher,
    writers, reader, delay timer, the waiting rank), each of which waits for a core on a busy
    machine; the profile's calibration run measures this per-message overhead off its trace
    (`wan_message_overhead_s`, messages.py) at the spec's latency, the profile's isolated probe
    how it changes with latency (`wan_messages`, message_overhead_s); added to the link latency
    and scaled with the CPU sharing of each run. A message queued behind another on the same
    connections pays the dispatcher/writer hand-off again as link time (the probe's back-to-back
    `gap_s`): the link's rate for boundary tensors is lowered by that much;
  * the ACK wait: a send completes when the receiver's ACK is back (transport/striped_send.py) and every
    rank waits for its sends before its optimizer step -- one round trip after the last byte left
    over the kernel WAN, only the hand-offs over the user-space shaper, which ACKs before it holds
    the message for the emulated latency (`ack_delays`; the simulator's WAIT_ACKS);
  * fp16 only: the runtime's per-step global all-reduce of (overflow flag, loss) over ALL ranks,
    before every optimizer step (runtime.trainer.Trainer.step): a gloo all-reduce, so it crosses the WAN
    where the ranks' gloo traffic does ("kernel" mode: ranks in DC namespaces; "shaper" mode: gloo
    stays on loopback, only StripedTransport is shaped). Added to each stage's optimizer time
    (`global_sync_s`); waiting for the slowest stage at that barrier is slack the simulator's
    schedule already has (the first stage, which finishes last, is on the critical path);
  * CPU contention: measured, when the run was (`rank_slowdown`: each rank's CPU + run-queue time
    over CPU time while it trained, wanrun.py), scales its stage's compute. Otherwise modelled:
    when more ranks compute at once than the machine has free cores, each is slower: processor
    sharing, k ranks computing beside b runnable threads of other work (sampled while the plan ran,
    cpuload.py, or the calibration run's effective background) get cores / (k + b) of a core
    each. The profile's measured slow-down table f(k) checks this model. Two ways to apply it:
    - ranks outnumber the host's cores (a CPU-emulated run: every stage's DC has gpu_type "cpu",
      all ranks on this host, ranks x threads > the profile's `cores`): the simulator's core pool
      (sim.cores) shares the cores instant by instant -- k units computing at once each run
      residual x max(1, (k + b) / C) slower, a rank waiting on a message holds no core and a rank
      woken by one shares with whoever computes then (`core_slowdown`);
    - otherwise (a core per rank, or GPUs) a fixed point of averages: simulate, measure per physical
      stage the time-averaged number of ranks computing while it computes, scale its compute by the
      slow-down, simulate again (3 rounds; it settles in 2). With a core per rank and a quiet
      machine that factor is the residual alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from geotrain.calibrate.profile_file import cost_profile
from geotrain.calibrate.waits import ack_delays, global_sync_s
from geotrain.costs import CostModel, comm
from geotrain.costs.memory import fsdp_gather_bytes_per_param
from geotrain.layout.wan_bytes import collective_bytes
from geotrain.schedule.actions import Op
from geotrain.sim import StageCost, simulate_costs
from geotrain.sim.simulate import plan_schedule
from geotrain.trace.metrics import WAN_COLLECTIVE_BYTES, trace_columns
from geotrain.trace.schema import TRAINING_COMPUTE_KINDS

CONTENTION_ROUNDS = 3


@dataclass
class CalibratedInputs:
    cluster: Any
    stage_costs: list            # geotrain.sim.StageCost per virtual stage
    allreduce: list[float]       # per physical stage
    optimizer: list[float]       # per physical stage: the step itself (CPU work)
    tokens: int
    global_sync: float = 0.0     # the world-wide loss/overflow all-reduce before each step (waiting, not CPU)
    ack_s: dict[str, float] | None = None   # per WAN direction: last byte out -> ACK at the sender (None: RTT)


def slowdown(concurrent: float, background: float, cores: int) -> float:
    """Processor sharing: `concurrent` of our ranks computing at once beside `background` runnable
    threads of other work on `cores` cores each get cores / (concurrent + background) of a core,
    at most one."""
    return max(1.0, (concurrent + background) / max(1, cores))


def core_slowdown(spec, plan, profile: dict, background: float, residual: float) -> list[float] | None:
    """The simulator's core pool table [unused, k=1, ..., k=units] for a CPU-emulated run whose ranks
    outnumber the host's cores: k units (tp ranks each) computing at once beside `background`
    runnable threads each run residual x max(1, (k x tp + background) / cores) slower (processor
    sharing, sim.cores says why). None when each rank has its own core or GPU: the pool is off.
    Both sides are known before the run: the plan's ranks (all on this host under the emulation)
    and the profile's `cores` (os.sched_getaffinity when it was taken)."""
    rt = profile.get("runtime", {})
    ncores = int(rt.get("cores", 0))
    threads = max(1, int(rt.get("threads", 1)))
    cpu = all(spec.cluster.dc(st.dc).gpu_type == "cpu" for st in plan.stages)
    if not cpu or ncores < 1 or plan.num_ranks * threads <= ncores:
        return None
    units = plan.pp * plan.dp
    return [1.0] + [residual * slowdown(k * plan.tp * threads, background, ncores) for k in range(1, units + 1)]


def calibrated_cluster(spec, profile: dict, background: float | None = None, mode: str = "shaper",
                       boundary_bytes: int = 0, message_scale: float | None = None, plan=None):
    """The spec's cluster with intra-DC latency/bandwidth replaced by the measured gloo p2p, and each
    WAN message's transport overhead (thread hand-offs in the user-space WAN, which wait for a core
    when the machine is busy) added to the WAN latency, scaled by the CPU sharing at `background`
    (processor sharing), or by `message_scale` when the run's CPU sharing was measured (predict)."""
    rt = profile.get("runtime", {})
    cluster = spec.cluster
    p2p = rt.get("p2p")
    if p2p:
        dcs = []
        for dc in cluster.datacenters:
            upd = {"intra_dc_latency_us": p2p["alpha_s"] * 1e6}
            if p2p["per_byte_s"] > 0:
                upd["intra_dc_gbps"] = 8 / p2p["per_byte_s"] / 1e9
            dcs.append(dc.model_copy(update=upd))
        cluster = cluster.model_copy(update={"datacenters": dcs})
    if mode == "off" and cluster.wan_links:
        # `--wan off`: no emulated WAN, every pair on gloo over loopback like a pair inside a DC.
        dc0 = cluster.datacenters[0]
        links = [wl.model_copy(update={"latency_ms": dc0.intra_dc_latency_us * 1e-3, "capacity_gbps": dc0.intra_dc_gbps,
                                       "per_connection_gbps": dc0.intra_dc_gbps}) for wl in cluster.wan_links]
        return cluster.model_copy(update={"wan_links": links})
    if cluster.wan_links and (rt.get("wan_message_overhead_s") or rt.get("wan_messages")):
        ncores = int(rt.get("cores", 1))
        b0 = float(rt.get("calibration_run", {}).get("background_runnable", 0.0))
        b = b0 if background is None else background
        scale = slowdown(1, b, ncores) / slowdown(1, b0, ncores) if message_scale is None else message_scale
        links = []
        for wl in cluster.wan_links:
            extra, gap = message_overhead_s(profile, wl.latency_ms)
            if mode != "shaper":
                # The kernel queues the next message's bytes while the transport hands it on: a
                # queued message pays no gap (measured: back-to-back arrivals size / rate apart).
                extra, gap = extra + gap, 0.0
            upd = {"latency_ms": wl.latency_ms + 1e3 * extra * scale}
            if gap > 0 and boundary_bytes:
                # Each message holds its connections for its stripe's size / rate + gap (a queued
                # message pays the hand-off again, whatever the number of stripes): the link's rate
                # for boundary-sized messages.
                lp = plan.link_between(*wl.between) if plan is not None else None
                stripe = boundary_bytes / (max(1, lp.connections) if lp is not None else 1)
                per_conn = stripe / (stripe / (wl.per_connection_gbps * 1e9 / 8) + gap * scale)
                upd["per_connection_gbps"] = per_conn * 8 / 1e9
                upd["capacity_gbps"] = wl.capacity_gbps * per_conn * 8 / 1e9 / wl.per_connection_gbps
            links.append(wl.model_copy(update=upd))
        cluster = cluster.model_copy(update={"wan_links": links})
    return cluster


def message_overhead_s(profile: dict, latency_ms: float) -> tuple[float, float]:
    """(per-message overhead, per-queued-message gap) in seconds on a WAN link of `latency_ms`.

    The level comes from the calibration run (`wan_message_overhead_s`, read off its trace at the
    spec's link latency L0, messages.py); how it changes with latency from the profile's isolated
    probe (`wan_messages.overhead_s` at PROBE_LATENCIES_MS, profile._wan_messages): the run's value
    times probe(L) / probe(L0), probe interpolated linearly in latency and flat past the ends. The
    hand-offs of a message wake threads that slept about one latency (reader, delay timer, the
    waiting rank); measured, the cost rises from 2 to 40 ms links and levels off (the validation
    traces: median 1.4 / 2.3 / 3.3 ms at 2 / 10 / 40 ms over five runs; an isolated probe
    0.7 / 0.9 / 1.3 ms on a loaded machine, 2.9 / 3.5 / 4.4 ms on a quiet one).

    The gap is charged as link time (calibrated_cluster lowers the link's rate for boundary-sized
    messages), so it is taken off the per-message overhead here: a message nobody queues behind
    costs the measured overhead in total, each one queued behind another pays the gap again. The
    probe's gap is scaled like its overhead (run / probe at L0): in the run the sender computes while
    its dispatcher and writer hand the next message on."""
    rt = profile.get("runtime", {})
    level = float(rt.get("wan_message_overhead_s", 0.0))
    probe = rt.get("wan_messages") or {}
    curve = sorted((float(k), float(v)) for k, v in probe.get("overhead_s", {}).items())
    gap = float(probe.get("gap_s", 0.0))
    if curve and all(v > 0 for _, v in curve):
        l0 = float(rt.get("calibration_run", {}).get("latency_ms", latency_ms))
        ref = _interp(curve, l0)
        # The run's hand-offs cost `in_run` times the probe's (the peer computes, the cores are
        # shared); the queued message's gap is made of the same hand-offs.
        in_run = level / ref if level > 0 else 1.0
        level, gap = in_run * _interp(curve, latency_ms), in_run * gap
    gap = min(gap, level)
    return max(0.0, level - gap), gap


def _interp(points: list[tuple[float, float]], x: float) -> float:
    xs, ys = zip(*points)
    return float(np.interp(x, xs, ys))


def profile_mode(profile: dict) -> str:
    """The WAN mode the profile's calibration run used ("shaper" for profiles made before modes)."""
    return profile.get("runtime", {}).get("calibration_run", {}).get("wan_mode", "shaper")


def fsdp_gather_s(plan, cost, units: range, rt: dict) -> tuple[float, float]:
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
    fit = rt.get("allreduce", {}).get(str(plan.dp))
    if not fit:
        return 0.0, 0.0
    blocks = [u for u in units if 0 < u <= cost.model.layers]
    root = [u for u in units if u not in blocks]
    groups = [[u] for u in blocks] + ([root] if root else [])
    param_bytes = fsdp_gather_bytes_per_param(cost.precision)
    gather = sum(fit["alpha_s"] + param_bytes * cost.stage_params(g) * fit["per_byte_s"] / 2 for g in groups)
    m = max(1, plan.num_microbatches)
    gathers = comm.fsdp_gathers(plan.sharding, m) * gather
    if plan.sharding == "zero3":
        return gathers / (2 * m), gathers / (2 * m)
    return gathers / m, 0.0


def calibrated_inputs(spec, plan, profile: dict, background: float | None = None,
                      mode: str | None = None, message_scale: float | None = None) -> CalibratedInputs:
    """Per-stage costs for `geotrain.sim.simulate_costs`, before contention (see module docstring)."""
    rt = profile.get("runtime", {})
    cost = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing,
                     optimizer=spec.job.optimizer, profile=cost_profile(profile))
    mode = mode or profile_mode(profile)
    boundary = cost.boundary_bytes(plan.micro_batch)   # what the runtime sends: the training dtype
    cluster = calibrated_cluster(spec, profile, background, mode, boundary, message_scale, plan)
    sched = plan_schedule(plan)
    per_action = float(rt.get("per_action_s", 0.0))
    factor = rt.get("compute_factor", {})
    split = rt.get("split_backward")
    # Interpreter time per compute action: its own plus its share of the stage's non-compute actions.
    compute_ops = {Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT}
    share = []
    for acts in sched.actions:
        n_comp = sum(1 for a in acts if a.op in compute_ops)
        share.append(per_action * len(acts) / max(1, n_comp))
    last = plan.pp * plan.virtual_per_stage - 1
    stage_costs = []
    for v, (a, b) in enumerate(plan.virtual_units()):
        dc = cluster.dc(plan.stages[v % plan.pp].dc)
        t = cost.with_checkpointing(plan.stage_checkpointing(v % plan.pp)).stage_times(  # the stage's own mode
            range(a, b), cluster.gpu(dc.gpu_type), plan.micro_batch)
        o = share[v % plan.pp]
        ff, fb = factor.get("forward", 1.0), factor.get("backward", 1.0)
        g_fwd, g_bwd = fsdp_gather_s(plan, cost, range(a, b), rt)
        b_in, b_w = t.backward_input, t.backward_weight
        if split:       # measured zero-bubble split (profile.time_split_backward)
            b_in, b_w = t.backward * split["input"], t.backward * split["weight"]
        b_in += g_bwd   # FSDP re-gathers at the first backward pass
        if v == 0:      # the runtime defers the first stage's whole backward to W (no input gradient to send)
            b_in, b_w = 0.0, t.backward + g_bwd
        stage_costs.append(StageCost(forward=(t.forward + g_fwd) * ff + o, backward=(t.backward + g_bwd) * fb + o,
                                     backward_input=b_in * fb + o / 2,
                                     backward_weight=b_w * fb + o / 2,
                                     send_bytes=boundary if v < last else 0))
    allreduce, optimizer = [], []
    sync = global_sync_s(spec, plan, profile, mode)
    ar = rt.get("allreduce", {})
    opt = rt.get("optimizer")
    for s, st in enumerate(plan.stages):
        dc = cluster.dc(st.dc)
        params = cost.stage_params(st.units)
        if plan.dp <= 1:
            allreduce.append(0.0)
        elif str(plan.dp) in ar:
            fit = ar[str(plan.dp)]
            key = "allreduce_first_stage" if s == 0 else "allreduce_other_stages"
            f = factor.get(key, factor.get("allreduce", 1.0))
            # replicated DP reduces in the training dtype (runtime.parallelize.allreduce_grads)
            allreduce.append((fit["alpha_s"] + cost.dtype_bytes * params * fit["per_byte_s"]) * f)
        else:
            # FSDP2's gathers are in the compute above (fsdp_gather_s): the sync is the reduction
            reduce = [c for c in cost.sync_collectives([st.units], plan.sharding, plan.num_microbatches)
                      if plan.sharding in ("replicate", "zero1") or c[0] == "reduce-scatter"]
            allreduce.append(comm.dp_sync_time(reduce, plan.dp, dc))
        if opt:
            step = (opt["fixed_s"] + params * opt["per_param_s"]) * factor.get("optimizer", 1.0)
        else:
            step = cost.optimizer_time(st.units, cluster.gpu(dc.gpu_type), plan.sharding, plan.dp)
        optimizer.append(step)
    return CalibratedInputs(cluster, stage_costs, allreduce, optimizer, plan.global_batch * spec.model.seq_len, sync,
                            ack_delays(spec, cluster, mode))



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


def predict(spec, plan, profile: dict, iterations: int = 3, contention: bool = True,
            background: float | None = None, mode: str | None = None,
            rank_slowdown: dict[int, float] | None = None):
    """Simulate `plan` with the calibrated inputs; returns (SimResult, details dict).

    background: other threads ready to run on the machine while the plan runs, on average
    (cpuload.CpuSampler.background_runnable); None: the background the profile's calibration run
    had, as the processor-sharing model reads its measured CPU shares (profile.py).
    mode: the runtime's WAN mode of the run predicted ("shaper", "kernel", "off"); None: the
    profile's calibration run's.
    rank_slowdown: {rank: CPU-sharing slow-down measured while the run trained} (wanrun.run_plan,
    from the kernel's per-thread run-queue wait): when given, each stage's compute is scaled by its
    ranks' mean instead of the processor-sharing model -- for runs on a machine whose other load
    is too bursty to model from a sample of runnable threads."""

    mode = mode or profile_mode(profile)
    # Measured CPU sharing: the message hand-offs slow down like the ranks' main threads did,
    # relative to the calibration run (the processor-sharing model of a bursty sampled background
    # read 6x at a background of 11 threads where the ranks measured 1.3-1.5x).
    msg_scale = None
    cal_slow = (profile.get("runtime", {}).get("calibration_run", {}).get("rank_slowdown") or {}).values()
    if rank_slowdown and contention and cal_slow:
        msg_scale = (sum(rank_slowdown.values()) / len(rank_slowdown)) / (sum(cal_slow) / len(cal_slow))
    inp = calibrated_inputs(spec, plan, profile, background, mode, msg_scale)
    rt = profile.get("runtime", {})
    ncores = int(rt.get("cores", 1))
    # Default: the conditions of the calibration run, which the compute factors were measured under.
    cal = rt.get("calibration_run", {})
    # Profiles with `sharing_residual`: processor sharing at the calibration run's sampled background,
    # times what its ranks lost beyond that. (The older additive "effective background" put that
    # loss into phantom runnable threads, which over-charged every plan that keeps both cores
    # busy: +27 % on the 2 ms link, quiet machine.)
    residual = float(cal.get("sharing_residual", 1.0)) if background is None else 1.0
    if background is None and "sharing_residual" in cal:
        bg = float(cal.get("background_runnable", 0.0))
        # Where the sampled count over-states what the calibration run's ranks measured (the
        # residual would be < 1: a load burst of many threads in few sessions, which the autogroup
        # scheduler shares by -- 20.8 runnable threads once, where the ranks' measured slow-down
        # read as 0.76), the background that reproduces their measured CPU share instead.
        if "background_effective" in cal:
            bg = min(bg, float(cal["background_effective"]))
    else:
        bg = float(cal.get("background_effective", cal.get("background_runnable", rt.get("background_runnable", 0.0)))
                   if background is None else background)
    factors = [1.0] * plan.pp
    res = None
    measured = bool(rank_slowdown) and contention
    # A dp >= 2 plan whose ranks outnumber the cores: what the profile's own dp = 2 run computed beyond
    # the pool's prediction (calibration_run.allreduce_factor_run says why), under the same conditions.
    # (The calibration run's own when the profiled job has dp >= 2, else its dp = 2 run's.)
    pool_residual = float(cal.get("pool_residual", cal.get("allreduce_run", {}).get("pool_residual", 1.0))) \
        if background is None and plan.dp >= 2 else 1.0
    pool = core_slowdown(spec, plan, profile, bg, residual * pool_residual) if contention and not measured else None
    if measured:
        factors = [sum(rank_slowdown.get(plan.rank(st, d), 1.0) for d in range(plan.dp)) / plan.dp
                   for st in range(plan.pp)]
    for _ in range(1 if measured or not contention or pool is not None else CONTENTION_ROUNDS):
        costs = [replace(c, forward=c.forward * factors[v % plan.pp], backward=c.backward * factors[v % plan.pp],
                         backward_input=c.backward_input * factors[v % plan.pp],
                         backward_weight=c.backward_weight * factors[v % plan.pp])
                 for v, c in enumerate(inp.stage_costs)]
        # The simulator has no global barrier: the all-reduce sits in each stage's optimizer time,
        # unscaled by CPU sharing (its ranks wait on the network, they do not compute).
        opt = [t * f + inp.global_sync for t, f in zip(inp.optimizer, factors)]
        res = simulate_costs(plan, inp.cluster, costs, inp.allreduce, opt, inp.tokens, iterations=iterations,
                             ack_s=inp.ack_s, core_slowdown=pool)
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
