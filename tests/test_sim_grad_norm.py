"""The simulator prices the gradient norm's exchange that clipping needs before every optimizer step:
the stages' sums travel down the pipeline to stage 0 and the total back up, one WAN latency per
boundary each way (runtime.recipe.GradNorm). In 1F1B stage 0 finishes last and finds the sum
waiting; the last stage's step waits for the total -- but no longer than it waits for stage 0's
next activations anyway, so the steady-state period hardly moves."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from geotrain.planner.manual import plan_from_job
from geotrain.sim import simulate
from geotrain.spec.load import load_spec

SPEC = Path(__file__).resolve().parents[1] / "examples" / "tiny_2dc.toml"


def _job(spec, **kw):
    return dataclasses.replace(spec, job=spec.job.model_copy(update=kw))


def _optimizer_starts(res, stage: int, plan) -> dict[int, float]:
    ranks = {plan.rank(stage, d) for d in range(plan.dp)}
    out: dict[int, float] = {}
    for e in res.trace.events:
        if e.kind == "optimizer" and e.rank in ranks:
            out[e.iteration] = min(out.get(e.iteration, 1e99), e.start)
    return out


def _period(res, plan) -> float:
    first = {}
    for e in res.trace.events:
        if e.kind == "forward" and e.rank == plan.rank(0, 0):
            first[e.iteration] = min(first.get(e.iteration, 1e99), e.start)
    its = sorted(first)
    return (first[its[-1]] - first[its[0]]) / (len(its) - 1)


def test_clipping_makes_the_last_stage_wait_for_stage_0s_total():
    spec = load_spec(SPEC)
    plan = plan_from_job(spec)                        # pp2 x dp2, east -> west, 10 ms one way
    hop = spec.cluster.link("east", "west").latency_ms * 1e-3
    on, off = simulate(spec, plan, iterations=4), simulate(_job(spec, grad_clip=0.0), plan, iterations=4)
    first_on, last_on = _optimizer_starts(on, 0, plan), _optimizer_starts(on, 1, plan)
    first_off, last_off = _optimizer_starts(off, 0, plan), _optimizer_starts(off, 1, plan)
    for it in first_on:
        assert last_on[it] >= first_on[it] + hop - 1e-9          # the total left stage 0 just before its step
        assert last_off[it] < first_off[it] + hop < last_on[it] + 1e-9   # unclipped, it steps earlier
    assert abs(_period(on, plan) - _period(off, plan)) < 0.005 * _period(off, plan)   # hidden in steady state
    assert on.metrics.iteration_time > off.metrics.iteration_time


def test_no_exchange_without_clipping_or_in_fp16():
    spec = load_spec(SPEC)
    plan = plan_from_job(spec)
    off = simulate(_job(spec, grad_clip=0.0), plan, iterations=2).metrics.iteration_time
    fp16 = plan.with_(precision="fp16")          # the norm rides in the overflow all-reduce it already runs
    assert simulate(spec, fp16, iterations=2).metrics.iteration_time == \
        simulate(_job(spec, grad_clip=0.0), fp16, iterations=2).metrics.iteration_time
    assert simulate(spec, plan, iterations=2).metrics.iteration_time > off
