"""Trace replay: the simulator re-run with a run's own measured compute durations -- never a prediction.

Every forward, backward (and its zero-bubble halves) and optimizer step takes, on every rank, the
time it took in the run (`measured_compute`, per op and per rank); everything else is the
calibrated model's (calibrate.calibrated_costs: the WAN transfers with their per-message overhead,
turns, the ACK wait, the DP all-reduce, the interpreter's time between actions, the schedule and
every wait that follows from them). So the replay's error is the network and schedule model's alone,
with the machine's compute drift -- which no prediction made before a run can know -- taken out.
The measured durations go to the engine per unit and slot (`sim.engine.run_engine(unit_dur=...)`):
a stage's `StageCosts` prices one micro-batch alike for every rank, a replay needs every action's own.
"""

from __future__ import annotations

from geotrain.calibrate.calibrated_costs import calibrated_inputs, profile_mode
from geotrain.calibrate.case_rows import drop_warmup
from geotrain.calibrate.profile_file import MeasuredProfile
from geotrain.layout.stage_costs import NormExchange, StageCosts
from geotrain.sim.columns import SimTrace
from geotrain.sim.engine import run_engine
from geotrain.sim.program import COMPUTE, compile_program
from geotrain.sim.simulate import SimResult, plan_schedule
from geotrain.trace.metrics import KINDS
from geotrain.trace.schema import TRAINING_COMPUTE_KINDS, Trace

Key = tuple[int, str, int, int, int]   # (rank, kind, virtual stage, micro-batch, iteration from 0)


def measured_compute(trace: Trace, warmup: int = 0) -> tuple[dict[Key, float], int]:
    """({(rank, kind, stage, mb, iteration): seconds} of every training compute event after the
    first `warmup` iterations, iterations counted from 0 again; the number of iterations kept)."""
    kept = drop_warmup(trace, warmup) if warmup else trace
    first = min(e.iteration for e in kept.events)
    out = {(e.rank, e.kind, e.stage, e.mb, e.iteration - first): e.end - e.start
           for e in kept.events if e.kind in TRAINING_COMPUTE_KINDS}
    return out, 1 + max(e.iteration for e in kept.events) - first


def replay_costs(plan, cluster, stage_costs, allreduce: list[float], optimizer: list[float], tokens: int,
                 compute: dict[Key, float], iterations: int, costs: StageCosts | None = None,
                 added: list[dict[str, float]] | None = None, step_sync: list[float] | None = None,
                 norm: NormExchange | None = None) -> SimResult:
    """`simulate_costs` with every compute slot's duration taken from `compute` (rank = the unit's
    first TP rank) plus `added[stage][kind]` (the model's time around a compute event, e.g. the
    interpreter's); the stage costs price only what is not measured (sends' bytes, the TP gathers).
    A compute action `compute` does not hold is a ValueError naming it."""
    sched = plan_schedule(plan)
    costs = costs if costs is not None else StageCosts(None, cluster)
    prog = compile_program(plan, costs, sched, stage_costs, allreduce, optimizer, iterations, step_sync=step_sync,
                           norm=norm)
    dp = plan.dp
    unit_dur = []
    for u in range(plan.pp * dp):
        s, d = divmod(u, dp)
        p = prog.stages[s]
        rank = plan.rank(s, d, 0)
        dur = list(p.dur)
        for slot, (op, kind) in enumerate(zip(p.ops, p.kind)):
            if op != COMPUTE or kind < 0 or KINDS[kind] not in TRAINING_COMPUTE_KINDS:
                continue
            key = (rank, KINDS[kind], p.vstage[slot], p.mb[slot], p.iteration[slot])
            if key not in compute:
                raise ValueError(f"the measured trace has no {key[1]} of stage {key[2]}, micro-batch {key[3]}, "
                                 f"iteration {key[4]} on rank {rank}")
            dur[slot] = compute[key] + (added[s].get(KINDS[kind], 0.0) if added else 0.0)
        unit_dur.append(dur)
    offsets = (list(plan.pipeline_offsets) + [0.0] * dp)[:dp]
    res = run_engine(prog, offsets, unit_dur=unit_dur)
    meta = {"plan": plan.name, "schedule": sched.kind, "iterations": iterations, "pp": plan.pp, "dp": dp,
            "tp": plan.tp, "num_microbatches": plan.num_microbatches, "tokens_per_iteration": tokens,
            "links": prog.link_meta, "replay": True}
    trace = SimTrace(prog, res, plan.rank_table, plan.num_ranks, meta)
    return SimResult(trace, sched, plan, None, tokens, None)   # iteration time: the metrics' (same definition)


def replay_run(spec, plan, profile: MeasuredProfile | dict, measured: Trace, warmup: int, mode: str | None = None,
               rank_slowdown: dict[int, float] | None = None) -> SimResult:
    """A validation case's run replayed: its measured compute (after `warmup` iterations) in the
    calibrated model of everything else, at the run's WAN mode. Added as modelled: the interpreter's
    time around each compute action (CalibratedCosts.share: outside the measured compute events) and
    the step-wide collective before each step (waits.global_sync_s, a wait as in `predict`) or
    clipping's norm exchange as messages (waits.norm_exchange). No
    CPU-sharing model for compute: the durations hold it. `rank_slowdown`: the run's measured CPU
    share per rank (wanrun.RunSampling, the post-hoc prediction's input): the CPU work outside
    compute -- the interpreter's time, the transport's hand-offs -- is slowed by it as in
    `calibrated_costs.predict(rank_slowdown=...)`."""
    msg_scale, factors = None, [1.0] * plan.pp
    cal = MeasuredProfile.of(profile).runtime.calibration_run.rank_slowdown.values()
    if rank_slowdown:
        if cal:
            msg_scale = (sum(rank_slowdown.values()) / len(rank_slowdown)) / (sum(cal) / len(cal))
        factors = [sum(rank_slowdown.get(plan.rank(s, d), 1.0) for d in range(plan.dp)) / plan.dp
                   for s in range(plan.pp)]
    inp = calibrated_inputs(spec, plan, profile, mode=mode or profile_mode(profile), message_scale=msg_scale)
    compute, iterations = measured_compute(measured, warmup)
    added = [{"forward": o * f, "backward": o * f, "backward_input": o * f / 2, "backward_weight": o * f / 2}
             for o, f in zip(inp.costs.share, factors)]
    return replay_costs(plan, inp.cluster, inp.stage_costs, inp.allreduce, inp.optimizer, inp.tokens, compute,
                        iterations, costs=inp.costs, added=added, step_sync=[inp.global_sync] * plan.pp,
                        norm=inp.norm)
