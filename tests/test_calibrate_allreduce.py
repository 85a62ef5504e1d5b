"""The DP all-reduce factor of a dp = 1 job's profile: measured in a dp = 2 run of its own.

The real runs are replaced by a stand-in machine (`run_plan` below): it simulates the plan it is
given with the same profile and stretches every gradient all-reduce 7x, as the validation runs'
collectives were stretched against the isolated gloo fit. What is under test -- the calibration
run's choice to run dp = 2 for a dp = 1 job, and the factor it reads off that run -- is real.
"""

from __future__ import annotations

import dataclasses

import pytest

from geotrain.calibrate import calibration_run as cr
from geotrain.calibrate.calibrated_costs import calibrated_inputs, predict
from geotrain.calibrate.cases import Case, write_spec
from geotrain.calibrate.timers import time_unit
from geotrain.planner.manual import plan_from_job
from geotrain.trace.metrics import compute_ratio
from geotrain.trace.schema import Trace

STRETCH = 7.0


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return write_spec(Case("ar", dp=1, latency_ms=5, per_connection_mbps=100), tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def profile(spec):
    m = spec.model
    prof = {kind: {"2": list(time_unit(m, index, 2, "bf16", repeats=3))}
            for kind, index in (("embedding", 0), ("block", 1), ("head", m.layers + 1))}
    prof["runtime"] = {"cores": 8, "background_runnable": 0.0, "per_action_s": 1e-4,
                       "optimizer": {"fixed_s": 1e-3, "per_param_s": 1e-9},
                       "allreduce": {"2": {"alpha_s": 1e-3, "per_byte_s": 1e-9}},
                       "p2p": {"alpha_s": 1e-4, "per_byte_s": 1e-9}}
    return prof


def test_a_dp1_profile_measures_the_allreduce_in_a_dp2_run(spec, profile, monkeypatch, tmp_path):
    ran = []

    def machine(spec_, plan, out, steps, mode, warmup):
        ran.append(plan.dp)
        sim, _ = predict(spec_, plan, profile, iterations=steps)
        events = [dataclasses.replace(e, end=e.start + STRETCH * e.duration) if e.kind == "allreduce" else e
                  for e in sim.trace.events]
        for e in events:
            e.iteration += 1        # the runtime counts iterations from 1
        out.mkdir(parents=True, exist_ok=True)
        Trace(events, sim.trace.num_ranks, "measured", sim.trace.meta).write_jsonl(out / "measured_trace.jsonl")
        return out / "measured_trace.jsonl", {"background_runnable": 0.0, "mode": "shaper", "rank_slowdown": {}}

    monkeypatch.setattr(cr, "run_plan", machine)
    factors, _, info = cr.calibration_run(spec, profile, steps=4, warmup=1, mode="shaper")
    assert ran == [1, 2]                                   # the job's own run, then the dp = 2 one
    assert factors["allreduce"] == pytest.approx(STRETCH) and factors["allreduce_first_stage"] == pytest.approx(STRETCH)
    assert info["allreduce_run"]["collective_s"] == pytest.approx(STRETCH * info["allreduce_run"]["fit_s"])
    # A dp = 2 plan predicted from that profile pays the measured collective, not the isolated fit.
    prof = {**profile, "runtime": {**profile["runtime"], "compute_factor": factors}}
    plan2 = plan_from_job(spec).with_(dp=2)
    fitted = calibrated_inputs(spec, plan2, profile).allreduce
    assert calibrated_inputs(spec, plan2, prof).allreduce == pytest.approx([STRETCH * a for a in fitted])
    # Without a dp = 2 fit (a quick 2-process profile without it) there is nothing to compare with.
    ran.clear()
    bare = {**profile, "runtime": {k: v for k, v in profile["runtime"].items() if k != "allreduce"}}
    factors, _, info = cr.calibration_run(spec, bare, steps=4, warmup=1, mode="shaper")
    assert ran == [1] and factors["allreduce"] == 1.0 and "allreduce_run" not in info


def test_a_failing_dp2_run_costs_the_profile_only_its_factor(spec, profile, monkeypatch):
    from geotrain.errors import GeotrainError

    real = cr.run_plan
    ran = []

    def machine(spec_, plan, out, steps, mode, warmup):
        ran.append(plan.dp)
        if plan.dp == 2:
            raise GeotrainError("rank 3 exited with 1 (logs: x)")
        return real(spec_, plan, out, steps=steps, mode=mode, warmup=warmup)

    monkeypatch.setattr(cr, "run_plan", machine)
    monkeypatch.setattr(cr, "predict", lambda *a, **k: (_ for _ in ()).throw(AssertionError("not reached")))
    factors, info = cr.allreduce_factor_run(spec, plan_from_job(spec), profile, 4, 1, "shaper")
    assert ran == [2, 2] and factors == {"allreduce": 1.0} and "rank 3 exited" in info["error"]


def test_the_first_stage_pays_its_own_measured_factor(spec, profile, monkeypatch):
    """In the dp2 runs the first stage's collective (on the critical path) is the slower one; the
    stand-in machine stretches stage 0's 9x and the last stage's 3x."""
    def machine(spec_, plan, out, steps, mode, warmup):
        sim, _ = predict(spec_, plan, profile, iterations=steps)
        events = [dataclasses.replace(e, end=e.start + (9.0 if e.stage == 0 else 3.0) * e.duration)
                  if e.kind == "allreduce" else e for e in sim.trace.events]
        out.mkdir(parents=True, exist_ok=True)
        Trace(events, sim.trace.num_ranks, "measured", sim.trace.meta).write_jsonl(out / "measured_trace.jsonl")
        return out / "measured_trace.jsonl", {"background_runnable": 0.0, "mode": "shaper", "rank_slowdown": {}}

    monkeypatch.setattr(cr, "run_plan", machine)
    factors, _, _ = cr.calibration_run(spec, profile, steps=4, warmup=1, mode="shaper")
    assert factors["allreduce_first_stage"] == pytest.approx(9.0)
    assert factors["allreduce_other_stages"] == pytest.approx(3.0)
    prof = {**profile, "runtime": {**profile["runtime"], "compute_factor": factors}}
    plan2 = plan_from_job(spec).with_(dp=2)
    fitted = calibrated_inputs(spec, plan2, profile).allreduce
    assert calibrated_inputs(spec, plan2, prof).allreduce == pytest.approx([9.0 * fitted[0], 3.0 * fitted[1]])


def test_a_gpu_host_without_four_devices_skips_the_dp2_run(spec, profile, monkeypatch):
    ran = []

    def machine(spec_, plan, out, steps, mode, warmup):
        ran.append(plan.dp)
        sim, _ = predict(spec_, plan, profile, iterations=steps)
        out.mkdir(parents=True, exist_ok=True)
        sim.trace.write_jsonl(out / "measured_trace.jsonl")
        return out / "measured_trace.jsonl", {"background_runnable": 0.0, "mode": "shaper", "rank_slowdown": {}}

    monkeypatch.setattr(cr, "run_plan", machine)
    monkeypatch.setattr(cr.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cr.torch.cuda, "device_count", lambda: 2)
    factors, _, info = cr.calibration_run(spec, profile, steps=4, warmup=1, mode="shaper")
    assert ran == [1] and "skipped" in info["allreduce_run"]
    assert factors["allreduce"] == factors.get("allreduce_first_stage", 1.0) == 1.0


def test_the_dp2_run_measures_what_oversubscribed_replicas_compute_beyond_the_pool(spec, profile, monkeypatch,
                                                                                 tmp_path):
    """Four ranks on two cores: the stand-in machine's dp = 2 run computes 1.4x what the core pool
    predicts (the validation set's pp2 x dp2 runs: 1.0-1.6x), its dp = 1 run as predicted. The
    profile keeps that as `pool_residual`; dp >= 2 plans predicted from it compute 1.4x, the
    others (pp4 x dp1 here) as before."""
    two = {**profile, "runtime": {**profile["runtime"], "cores": 2}}

    def machine(spec_, plan, out, steps, mode, warmup):
        sim, _ = predict(spec_, plan, two, iterations=steps)
        f = 1.4 if plan.dp == 2 else 1.0
        events = [dataclasses.replace(e, end=e.start + f * e.duration) if e.kind in ("forward", "backward") else e
                  for e in sim.trace.events]
        out.mkdir(parents=True, exist_ok=True)
        Trace(events, sim.trace.num_ranks, "measured", sim.trace.meta).write_jsonl(out / "measured_trace.jsonl")
        return out / "measured_trace.jsonl", {"background_runnable": 0.0, "mode": "shaper", "rank_slowdown": {}}

    monkeypatch.setattr(cr, "run_plan", machine)
    factors, _, info = cr.calibration_run(spec, two, steps=4, warmup=1, mode="shaper")
    assert info["allreduce_run"]["pool_residual"] == pytest.approx(1.4, rel=0.05)
    before = {**two, "runtime": {**two["runtime"], "compute_factor": factors,
                                 "calibration_run": {k: v for k, v in info.items() if k != "allreduce_run"}}}
    after = {**two, "runtime": {**two["runtime"], "compute_factor": factors, "calibration_run": info}}

    def compute(prof, plan, sp=spec):
        sim, det = predict(sp, plan, prof, iterations=3)
        assert det["core_pool"]                          # ranks outnumber the cores: the pool is on
        return sum(e.duration for e in sim.trace.events if e.kind in ("forward", "backward")), det["core_pool"]

    dp2 = plan_from_job(spec).with_(dp=2)
    (slow, pool), (fast, pool0) = compute(after, dp2), compute(before, dp2)
    residual = info["allreduce_run"]["pool_residual"]
    assert pool[1:] == pytest.approx([residual * x for x in pool0[1:]], rel=1e-12)   # every k slowed by it
    assert slow > 1.3 * fast             # and compute with it (more than 1.4x: slower jobs overlap more)
    four = write_spec(Case("ar4", pp=4, dp=1, latency_ms=5, per_connection_mbps=100), tmp_path)
    pp4 = plan_from_job(four)
    assert pp4.dp == 1 and pp4.num_ranks == 4
    assert compute(after, pp4, four)[0] == pytest.approx(compute(before, pp4, four)[0], rel=1e-9)


def test_a_dp2_jobs_profile_predicts_its_own_calibration_runs_compute(profile, monkeypatch, tmp_path):
    """The demo's case: the profiled job is pp2 x dp2 on two cores. The stand-in machine computes
    1.5x the pool's prediction and its ranks report a run-queue slow-down of 1.2 (what the
    calibration run's factors are measured against). A plan predicted from the finished profile --
    the same plan, as `geotrain train --profile` predicts the demo -- must compute what that run
    computed; without the residual it came out at 0.89 of it."""
    two = {**profile, "runtime": {**profile["runtime"], "cores": 2}}
    spec2 = write_spec(Case("ar2", dp=2, latency_ms=5, per_connection_mbps=100), tmp_path)
    runs = []

    def machine(spec_, plan, out, steps, mode, warmup):
        sim, _ = predict(spec_, plan, two, iterations=steps)
        events = [dataclasses.replace(e, end=e.start + 1.5 * e.duration) if e.kind in ("forward", "backward") else e
                  for e in sim.trace.events]
        runs.append(events)
        out.mkdir(parents=True, exist_ok=True)
        Trace(events, sim.trace.num_ranks, "measured", sim.trace.meta).write_jsonl(out / "measured_trace.jsonl")
        return out / "measured_trace.jsonl", {"background_runnable": 0.0, "mode": "shaper",
                                              "rank_slowdown": {r: 1.2 for r in range(plan.num_ranks)}}

    monkeypatch.setattr(cr, "run_plan", machine)
    factors, overhead, info = cr.calibration_run(spec2, two, steps=4, warmup=1, mode="shaper")
    done = {**two, "runtime": {**two["runtime"], "compute_factor": factors, "wan_message_overhead_s": overhead,
                               "calibration_run": info}}
    sim, det = predict(spec2, plan_from_job(spec2), done, iterations=3)
    assert det["core_pool"]
    ratio = compute_ratio(sim.trace, Trace(runs[0], sim.trace.num_ranks, "measured"), cr.POOLED_KINDS)
    assert ratio == pytest.approx(1.0, abs=0.05)
