"""The calibration run: a real 2-stage pipeline of the spec's model, compared with its simulation.

From its trace come the profile's compute factors (what the runtime adds to isolated unit times
when ranks run side by side), the per-message WAN overhead and the global all-reduce.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path

import torch

from geotrain.calibrate.calibrated_costs import predict, slowdown
from geotrain.calibrate.case_rows import drop_warmup
from geotrain.calibrate.messages import global_sync, waiting_overhead
from geotrain.calibrate.profile_file import RUNTIME_KEY
from geotrain.calibrate.wanrun import DEFAULT_MODE, run_plan
from geotrain.errors import GeotrainError
from geotrain.layout.plan import StagePlan
from geotrain.planner.manual import plan_from_job, split_even
from geotrain.trace.metrics import compute_metrics, compute_ratio
from geotrain.trace.schema import Trace


def collective_s(events) -> float:
    """The DP gradient reduction's own duration in a measured trace: per (iteration, stage) the
    shortest of its replicas' allreduce events (the replica that arrived last waits only for the
    collective; the others' events also hold their wait for it, which the simulator puts before
    the collective), median over those groups; 0.0 without any."""
    groups: dict[tuple[int, int], float] = {}
    for e in events:
        if e.kind == "allreduce":
            key = (e.iteration, e.stage)
            groups[key] = min(groups.get(key, float("inf")), e.duration)
    return statistics.median(groups.values()) if groups else 0.0


def collective_by_stage(events) -> dict[int, float]:
    """`collective_s` per stage: {stage: median over iterations of its replicas' shortest allreduce}."""
    groups: dict[tuple[int, int], float] = {}
    for e in events:
        if e.kind == "allreduce":
            key = (e.iteration, e.stage)
            groups[key] = min(groups.get(key, float("inf")), e.duration)
    return {s: statistics.median(v for (_, st), v in groups.items() if st == s) for s in {k[1] for k in groups}}


def allreduce_factors(pred_events, measured_events) -> dict[str, float]:
    """In-run over simulated DP all-reduce: "allreduce" over all stages, and apart for the first
    stage and the others ("allreduce_first_stage", "allreduce_other_stages"). Apart because they
    differ where it matters: in the stored dp2 runs the first stage's collective -- the one on the
    critical path, between its last backward and its optimizer step -- took 1.2-14 ms against
    1.6-9.5 ms on the last stage (shortest replica, median per run; longer in 7 of 8 runs)."""
    def ratio(p: list[float], m: float | None) -> float:
        return m / (sum(p) / len(p)) if p and m and sum(p) > 0 else 1.0

    pred = [e for e in pred_events if e.kind == "allreduce"]
    out = {"allreduce": ratio([e.duration for e in pred], collective_s(measured_events) or None)}
    by_stage = collective_by_stage(measured_events)
    if len(by_stage) > 1:
        first = min(by_stage)
        out["allreduce_first_stage"] = ratio([e.duration for e in pred if e.stage == first], by_stage[first])
        rest = [e.duration for e in pred if e.stage != first]
        out["allreduce_other_stages"] = ratio(rest, statistics.median(v for s, v in by_stage.items() if s != first))
    return out


# The compute the core pool shares (the pool residual's numerator and denominator).
POOLED_KINDS = frozenset({"forward", "backward", "backward_input", "backward_weight"})


def _room_for(ranks: int) -> bool:
    """Whether `ranks` ranks can run here: any number on CPUs, one per device on a GPU host (the
    runtime places rank r on cuda:LOCAL_RANK)."""
    return not torch.cuda.is_available() or torch.cuda.device_count() >= ranks


def _mean(events, kind) -> float:
    d = [e.duration for e in events if e.kind == kind]
    return sum(d) / len(d) if d else 0.0


def allreduce_factor_run(spec, plan, profile: dict, steps: int, warmup: int, mode: str) -> tuple[dict, dict]:
    """The DP all-reduce's in-run factor for a job whose own calibration run has dp = 1: the same
    2-stage pipeline at dp = 2 (four ranks), run for real, its collectives' duration
    (`collective_s`) over the calibrated simulation's (the isolated gloo fit at dp = 2), overall and
    per stage (`allreduce_factors`).

    Why a run and not a probe: in the validation set's dp2 runs the gradient reduction took 1.3-13 ms
    (shortest replica, median per run) where the fit says 0.55-0.77 ms, and a two-process probe of
    the same bytes -- the partner idle in the collective for 0-100 ms, two other processes computing
    or not -- stayed at 0.5-1.3 ms: what inflates it lives in the running pipeline (its transport
    threads, the other stage's ranks on the same cores), so it is measured where it happens, in a
    run of its own taken with the profile, before and apart from any run it predicts.

    The same run also gives `pool_residual` (info) where its four ranks outnumber the cores: its
    ranks' compute over what the core pool predicts for it (trace.metrics.compute_ratio). The validation set's
    pp2 x dp2 runs computed 1.0-1.6x the pool's prediction (mean 1.32 over six quiet runs, where the
    2-rank cases were at 0.99-1.34, mean 1.15): the replicas compute in lockstep, so both cores are
    busy when the emulation's own work (the packet delayer, softirqs, the other stage) needs one.
    costs.predict applies it to CPU-emulated plans with dp >= 2 whose ranks outnumber the cores --
    the layout it was measured on.

    A run that fails twice (a rank's start-up or exit racing on a loaded machine) costs the profile
    nothing but these factors: 1.0 (the isolated fit) and the error on the record."""
    dp2 = plan.with_(dp=2, name="profile-calibration-dp2")
    errors = []
    for _ in range(2):
        try:
            with tempfile.TemporaryDirectory() as tmp:
                path, cond = run_plan(spec, dp2, Path(tmp) / "run", steps=steps, mode=mode, warmup=warmup)
                measured = drop_warmup(Trace.read_jsonl(path), warmup)
            break
        except GeotrainError as e:
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    else:
        return {"allreduce": 1.0}, {"plan": f"pp=2 x dp=2 1f1b {dp2.sharding}", "error": "; ".join(errors)}
    sim, _ = predict(spec, dp2, profile, iterations=steps - warmup, background=cond["background_runnable"],
                     mode=cond["mode"], rank_slowdown=cond["rank_slowdown"])
    p, m = _mean(sim.trace.events, "allreduce"), collective_s(measured.events)
    info = {"plan": f"pp=2 x dp=2 1f1b {dp2.sharding}", "collective_s": m, "fit_s": p,
            "collective_by_stage_s": collective_by_stage(measured.events),
            "background_runnable": cond["background_runnable"]}
    # The same run predicted as a validation case is (the core pool where 4 ranks outnumber the
    # cores, the calibration run's background): what its ranks' compute took beyond that.
    pooled, det = predict(spec, dp2, profile, iterations=steps - warmup, mode=cond["mode"])
    if det.get("core_pool"):
        info["pool_residual"] = compute_ratio(pooled.trace, measured, POOLED_KINDS) or 1.0
    return allreduce_factors(sim.trace.events, measured.events), info


def calibration_run(spec, profile: dict, steps: int = 12, warmup: int = 3,
                     mode: str | None = None, dp_probe: bool = True) -> tuple[dict[str, float], float, dict]:
    """Run a 2-stage pipeline of the spec's model for real (over the spec's WAN, through the runtime's
    launcher in WAN `mode`, as validation runs and `geotrain train` do) and compare each compute kind's
    mean duration with the calibrated simulation's: the ratio is what the runtime adds to the isolated
    unit times when ranks run side by side (the other rank's transfers and threads, the allocator, the
    recorder), beyond the CPU sharing costs.py models; for the DP all-reduce (dp > 1) the ratio of the
    collective's in-run duration to the isolated gloo fit (on 2 cores, 4 ranks' gloo threads wait for
    cores: 12 ms in the run where the fit says 3.6). From the same trace: the per-message WAN
    transport overhead and the global all-reduce (messages.py). dp_probe: when the job has dp = 1
    and the profile has a dp = 2 gloo fit, measure the all-reduce factor in a dp = 2 run of its
    own (`allreduce_factor_run`; info["allreduce_run"]), so that dp = 2 plans predicted from this
    profile do not take the isolated fit for what the collective costs in a pipeline."""
    base = plan_from_job(spec)
    dcs = [st.dc for st in base.stages]
    dcs = (dcs[0], dcs[-1])
    stages = tuple(StagePlan(dc=d, chunks=(r,)) for d, r in zip(dcs, split_even(spec.model.num_units, 2)))
    # The job's DP degree and sharding stay: with dp > 1 the ranks outnumber the cores here and the DP
    # collectives (FSDP all-gathers in every forward/backward under zero3) wait for partners that
    # are not running; the compute factors then carry that for the layout the job trains.
    plan = base.with_(stages=stages, schedule="1f1b", checkpointing="none",
                      num_microbatches=max(2, min(base.num_microbatches, 4)), extra_warmup=(), pipeline_offsets=(),
                      links=tuple(dataclasses.replace(lp, order=()) for lp in base.links),
                      name="profile-calibration")
    with tempfile.TemporaryDirectory() as tmp:
        path, cond = run_plan(spec, plan, Path(tmp) / "run", steps=steps, mode=mode or DEFAULT_MODE, warmup=warmup)
        measured = drop_warmup(Trace.read_jsonl(path), warmup)
    background, mode, slow = cond["background_runnable"], cond["mode"], cond["rank_slowdown"]
    # The factors are measured against the CPU share the ranks really got (run-queue wait), so they
    # hold what the runtime adds beyond CPU sharing, whatever else the machine ran meanwhile.
    sim, det = predict(spec, plan, profile, iterations=steps - warmup, background=background, mode=mode,
                       rank_slowdown=slow)
    pred_events = sim.trace.events

    factors = {}
    for kind in ("forward", "backward", "optimizer"):
        p, m = _mean(pred_events, kind), _mean(measured.events, kind)
        if kind == "optimizer":       # the simulated step carries the global all-reduce; the trace records it apart
            p -= det["global_sync_s"]
        factors[kind] = m / p if p > 0 and m > 0 else 1.0
    factors.update(allreduce_factors(pred_events, measured.events))
    info = {"plan": f"pp=2 x dp={plan.dp} 1f1b {plan.sharding}", "num_microbatches": plan.num_microbatches,
            "background_runnable": background, "steps": steps, "warmup": warmup, "wan_mode": mode,
            "rank_slowdown": slow, "background_sessions": cond.get("background_sessions")}
    # What a WAN message and the global loss/overflow all-reduce cost, read off the trace
    # (messages.py says why not a fit on the iteration time).
    measured_it = compute_metrics(measured, 1).iteration_time
    overhead = 0.0
    a, b = plan.stages[0].dc, plan.stages[-1].dc
    link = spec.cluster.link(a, b) if a != b else None
    if link is not None:
        lp = plan.link_between(a, b)
        conns = max(1, lp.connections) if lp is not None else 1
        rate_Bps = min(conns * link.per_connection_gbps, link.capacity_gbps) * 1e9 / 8
        overhead = waiting_overhead(measured, plan, link.latency_ms * 1e-3, 1 / rate_Bps, 0) or 0.0
    info["global_sync_s"] = global_sync(measured, 0) or 0.0
    info["latency_ms"] = link.latency_ms if link is not None else 0.0
    info["ranks"] = plan.num_ranks
    info["measured_iteration_s"] = measured_it
    # The background that makes the processor-sharing model (k ranks computing beside b others on C
    # cores: (k + b) / C) give the slow-down the ranks really had: the default for predictions of runs
    # nobody measured (`geotrain train --profile`).
    if slow:
        cores = int(profile[RUNTIME_KEY].get("cores", 1))
        k = sum(det["compute_concurrency"]) / len(det["compute_concurrency"])
        info["background_effective"] = max(0.0, cores * sum(slow.values()) / len(slow) - k)
        # What the ranks lost beyond oversubscribed cores (transport threads, interrupts, other
        # work), as a factor: costs.predict multiplies the processor-sharing slow-down by it.
        info["sharing_residual"] = max(1.0, sum(slow.values()) / len(slow) / slowdown(k, background, cores))
    if plan.dp >= 2:
        # The job's own layout has ranks replicated in lockstep: where they outnumber the cores, what they
        # computed beyond the core pool's prediction of this very run (allreduce_factor_run says why).
        known = {**profile, RUNTIME_KEY: {**profile[RUNTIME_KEY], "compute_factor": dict(factors),
                                          "wan_message_overhead_s": overhead, "calibration_run": info}}
        pooled, pdet = predict(spec, plan, known, iterations=steps - warmup, mode=mode)
        if pdet.get("core_pool"):
            info["pool_residual"] = compute_ratio(pooled.trace, measured, POOLED_KINDS) or 1.0
    if dp_probe and plan.dp == 1 and "2" in profile[RUNTIME_KEY].get("allreduce", {}) and not _room_for(4):
        info["allreduce_run"] = {"skipped": "a rank per GPU and fewer than 4 GPUs here"}
    elif dp_probe and plan.dp == 1 and "2" in profile[RUNTIME_KEY].get("allreduce", {}):
        known = {**profile, RUNTIME_KEY: {**profile[RUNTIME_KEY], "compute_factor": dict(factors),
                                          "wan_message_overhead_s": overhead, "calibration_run": info}}
        ar, info["allreduce_run"] = allreduce_factor_run(spec, plan, known, steps, warmup, mode)
        factors.update(ar)
    return factors, overhead, info
