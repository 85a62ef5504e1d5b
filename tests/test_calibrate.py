"""Calibration: the profile file, the calibrated simulation inputs and the comparison arithmetic.

The profile's unit times are fixed numbers (the arithmetic under test must not depend on how fast
this machine is at the moment; `time_unit` is exercised by the calibration-run tests); nothing
under test is mocked.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from geotrain.calibrate.calibrated_costs import calibrated_inputs, compute_concurrency, predict, slowdown
from geotrain.calibrate.case_rows import (
    compare_case,
    drop_warmup,
    markdown_table,
    rel_error,
    summarize,
)
from geotrain.calibrate.profile_file import cost_profile, load_profile, save_profile
from geotrain.calibrate.timers import fit_line
from geotrain.costs import CostModel
from geotrain.errors import GeotrainError
from geotrain.planner.manual import plan_from_job
from geotrain.trace.metrics import Metrics
from geotrain.trace.schema import Event, Trace


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    from geotrain.calibrate.cases import Case, write_spec

    return write_spec(Case("unit", dp=2, latency_ms=5, per_connection_mbps=100), tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def unit_profile(spec):
    """A profile with unit times (what `geotrain profile` writes first), fixed: a compute-bound
    case -- a block's forward 1 ms, its backward 2 ms, where the 16 KiB boundary tensor takes
    1.3 ms plus the 5 ms link. Measured ones made the contention tests flaky: on a quiet machine
    (a block's forward 0.3 ms) the link bounds the iteration, so sharing the cores changes
    nothing (the same iteration time with and without contention), and the dp = 1 pipeline's two
    stages never compute at once."""
    prof = {"embedding": {"2": [2e-5, 4e-5]}, "block": {"2": [1e-3, 2e-3]}, "head": {"2": [1e-3, 2e-3]}}
    prof["runtime"] = {"cores": 2, "background_runnable": 0.0, "per_action_s": 1e-4,
                       "optimizer": {"fixed_s": 1e-3, "per_param_s": 1e-9},
                       "allreduce": {"2": {"alpha_s": 2e-3, "per_byte_s": 1e-9}},
                       "p2p": {"alpha_s": 1e-4, "per_byte_s": 1e-9},
                       "compute_factor": {"forward": 1.0, "backward": 1.0, "optimizer": 1.0}}
    return prof


def test_profile_round_trips_and_drives_the_cost_model(tmp_path, spec, unit_profile):
    path = tmp_path / "profile.json"
    save_profile(unit_profile, path)
    loaded = load_profile(path)
    assert loaded.as_dict() == unit_profile
    assert loaded.runtime.cores == unit_profile["runtime"]["cores"]          # typed: named fields
    assert loaded.runtime.allreduce["2"].alpha_s == unit_profile["runtime"]["allreduce"]["2"]["alpha_s"]
    m, gpu = spec.model, spec.cluster.gpu("cpu")
    plain = CostModel(m, precision="bf16")
    measured = CostModel(m, precision="bf16", profile=cost_profile(loaded))
    units = range(0, 3)                        # embedding + 2 blocks
    t = measured.stage_times(units, gpu, 2)
    emb, blk = loaded.embedding["2"], loaded.block["2"]
    assert t.forward == pytest.approx(emb[0] + 2 * blk[0])
    assert t.backward == pytest.approx(emb[1] + 2 * blk[1])
    assert t.forward != pytest.approx(plain.stage_times(units, gpu, 2).forward, rel=0.05)


def test_load_profile_rejects_other_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(GeotrainError, match="not a geotrain profile"):
        load_profile(bad)
    with pytest.raises(GeotrainError, match="not found"):
        load_profile(tmp_path / "missing.json")


def test_fit_line_recovers_a_line_and_never_goes_negative():
    a, b = fit_line([1, 2, 3, 4], [3, 5, 7, 9])
    assert (a, b) == (pytest.approx(1.0), pytest.approx(2.0))
    a, b = fit_line([1, 2], [5, 1])            # a falling cost is noise: flat at the mean
    assert b == 0.0 and a == pytest.approx(3.0)


def test_calibrated_inputs_use_the_measured_numbers(spec, unit_profile):
    plan = plan_from_job(spec)
    inp = calibrated_inputs(spec, plan, unit_profile)
    rt = unit_profile["runtime"]
    cost = CostModel(spec.model, precision="bf16")
    for s, st in enumerate(plan.stages):
        params = cost.stage_params(st.units)
        assert inp.allreduce[s] == pytest.approx(2e-3 + 2 * params * 1e-9)     # bf16: reduced in bf16
        assert inp.optimizer[s] == pytest.approx(1e-3 + params * 1e-9)
    # bf16: no world-wide loss/overflow all-reduce (only fp16 must agree on skipped steps); with clipping
    # (the job's default) the global norm's messages: a hop each way inside each stage, one per boundary
    assert inp.global_sync == 0.0
    assert inp.norm.reduce == pytest.approx([2 * rt["p2p"]["alpha_s"]] * 2)
    no_clip = dataclasses.replace(spec, job=spec.job.model_copy(update={"grad_clip": 0.0}))
    assert calibrated_inputs(no_clip, plan, unit_profile).global_sync == 0.0
    assert calibrated_inputs(no_clip, plan, unit_profile).norm is None
    # ... fp16: 2 log2(n) = 4 gloo hops on loopback
    fp16 = calibrated_inputs(spec, plan.with_(precision="fp16"), unit_profile)
    assert fp16.global_sync == pytest.approx(4 * rt["p2p"]["alpha_s"])
    # The interpreter overhead is spread over the compute actions of each stage.
    blk = unit_profile["block"]["2"]
    n = len(plan.stages[1].units) - 1           # blocks of the last stage (its other unit is the head)
    fwd = n * blk[0] + unit_profile["head"]["2"][0]
    from geotrain.sim.simulate import plan_schedule

    acts = plan_schedule(plan).actions[1]
    n_compute = sum(1 for a in acts if a.op.value in ("forward", "backward"))
    assert inp.stage_costs[1].forward == pytest.approx(fwd + 1e-4 * len(acts) / n_compute)
    # boundary tensors cross in the training dtype: the bytes the plain cost model counts
    assert inp.stage_costs[0].send_bytes == cost.boundary_bytes(plan.micro_batch)
    assert inp.stage_costs[0].send_bytes == 2 * plan.micro_batch * spec.model.seq_len * spec.model.hidden
    assert inp.cluster.dc("east").intra_dc_latency_us == pytest.approx(rt["p2p"]["alpha_s"] * 1e6)


def test_slowdown_is_processor_sharing():
    assert slowdown(1, 0.0, 2) == 1.0
    assert slowdown(2, 0.0, 2) == 1.0
    assert slowdown(4, 0.0, 2) == 2.0
    assert slowdown(2, 1.0, 2) == 1.5


def test_contention_slows_a_dp2_pipeline_sharing_two_cores(spec, unit_profile):
    plan = plan_from_job(spec)                  # pp=2 x dp=2: 4 ranks on 2 cores
    res0, _ = predict(spec, plan, unit_profile, iterations=2, contention=False)
    conc = compute_concurrency(res0, plan)
    assert all(1.0 <= c <= plan.num_ranks for c in conc)
    assert max(conc) > 2.0                      # both replicas of a stage compute in lock-step
    res1, det = predict(spec, plan, unit_profile, iterations=2)
    # Four CPU ranks on two cores: the simulator's core pool shares them (processor sharing).
    assert det["core_pool"][1:5] == pytest.approx([1.0, 1.0, 1.5, 2.0])
    assert res1.metrics.iteration_time > res0.metrics.iteration_time
    # Two ranks on two cores, or GPUs: no pool, the averaged factors as before.
    _, det2 = predict(spec, plan.with_(dp=1), unit_profile, iterations=2)
    assert det2["core_pool"] is None
    gpu = spec.cluster.model_copy(update={"datacenters": [d.model_copy(update={"gpu_type": "h100-80g"})
                                                          for d in spec.cluster.datacenters]})
    _, det3 = predict(dataclasses.replace(spec, cluster=gpu), plan, unit_profile, iterations=2)
    assert det3["core_pool"] is None and max(det3["contention_factors"]) > 1.0


def test_a_profile_file_goes_straight_into_the_cost_model(tmp_path, unit_profile):
    import json

    path = tmp_path / "profile.json"
    save_profile(unit_profile, path)
    m = CostModel(__import__("geotrain.models.presets", fromlist=["PRESETS"]).PRESETS["tiny"], precision="bf16",
                  profile=json.loads(path.read_text()))          # the "runtime" key is ignored, not refused
    assert m.profile.has("block")


def test_global_sync_crosses_the_wan_only_where_gloo_does(spec, unit_profile):
    from geotrain.calibrate.calibrated_costs import global_sync_s
    from geotrain.calibrate.waits import norm_exchange

    prof = {**unit_profile, "runtime": {**unit_profile["runtime"], "p2p": {"alpha_s": 1e-4, "per_byte_s": 0.0}}}
    plan = plan_from_job(spec)                  # pp=2 x dp=2, ranks 0,1 east and 2,3 west; link 5 ms
    hop, lat = 1e-4, 5e-3
    no_clip = dataclasses.replace(spec, job=spec.job.model_copy(update={"grad_clip": 0.0}))
    assert global_sync_s(no_clip, plan, prof, "kernel") == 0.0   # bf16 without clipping: no step-wide collective
    assert norm_exchange(no_clip, plan, prof, "kernel") is None
    # bf16 clipping: no world-wide collective; the norm inside each stage (dp 2: one hop each way), then
    # one message per boundary and direction, across the WAN where gloo crosses it (kernel mode)
    assert global_sync_s(spec, plan, prof, "kernel") == 0.0
    kernel, shaper = norm_exchange(spec, plan, prof, "kernel"), norm_exchange(spec, plan, prof, "shaper")
    assert kernel.reduce == pytest.approx([2 * hop, 2 * hop]) and kernel.hop == pytest.approx([hop + lat])
    assert shaper.reduce == pytest.approx([2 * hop, 2 * hop]) and shaper.hop == pytest.approx([hop])
    plan = plan.with_(precision="fp16")
    assert norm_exchange(spec, plan, prof, "kernel") is None      # fp16: the norm rides in the overflow all-reduce
    # Halving-doubling: pairs (0,1),(2,3) inside a DC, then (0,2),(1,3) across the WAN; reduce + gather.
    assert global_sync_s(spec, plan, prof, "kernel") == pytest.approx(4 * hop + 2 * lat)
    assert global_sync_s(spec, plan, prof, "shaper") == pytest.approx(4 * hop)
    one = plan.with_(dp=1)
    assert global_sync_s(spec, one, prof, "kernel") == pytest.approx(2 * hop + 2 * lat)   # one round trip
    # A measured collective (calibration run, n=2: two steps) sets the hand-off per edge.
    cal = {**prof, "runtime": {**prof["runtime"], "calibration_run": {"global_sync_s": 4e-3, "wan_mode": "shaper"}}}
    assert global_sync_s(spec, one, cal, "shaper") == pytest.approx(4e-3)
    # ... and every stage waits for it before its step (a wait, as the run records it: no compute, no sync event).
    inp = calibrated_inputs(spec, one, cal, mode="shaper")
    sim, det = predict(spec, one, cal, iterations=2, mode="shaper", contention=False)
    assert det["global_sync_s"] == pytest.approx(4e-3)
    opt = sorted({round(e.duration, 9) for e in sim.trace.events if e.kind == "optimizer"})
    assert opt == pytest.approx(sorted({round(t, 9) for t in inp.optimizer}))
    # bf16: the partial sum reaches stage 0 one edge after the last stage's last backward, so stage 0
    # (last to finish in 1F1B) steps when it would unclipped; the last stage waits for the total.
    bf16 = one.with_(precision="bf16")
    base, _ = predict(no_clip, bf16, cal, iterations=2, mode="kernel", contention=False)
    clip, _ = predict(spec, bf16, cal, iterations=2, mode="kernel", contention=False)
    edge = norm_exchange(spec, bf16, cal, "kernel").hop[0]

    def steps(res, stage):
        return sorted(e.start for e in res.trace.events if e.kind == "optimizer" and e.rank == bf16.rank(stage, 0))
    for a, b in zip(steps(clip, 0), steps(base, 0)):
        assert a == pytest.approx(b, abs=1e-9)
    for a, b in zip(steps(clip, 1), steps(clip, 0)):
        assert a >= b + edge - 1e-9                                  # the total left stage 0 at its step
    waits = [e for e in clip.trace.events if e.kind == "recv_wait" and e.mb == -1]
    assert waits and clip.iteration_time > base.iteration_time


@pytest.mark.parametrize("precision,param_bytes", [("bf16", 2), ("fp32", 4), ("fp16", 4)])
def test_zero3_gathers_parameters_m_plus_one_times_in_the_param_dtype(spec, unit_profile, precision, param_bytes):
    """FSDP2 gathers in its MixedPrecisionPolicy's param dtype (bf16 under bf16; fp16 and fp32
    gather the fp32 weights), zero3 m+1 times per iteration (costs.comm.fsdp_gathers: a forward
    reshards, a backward keeps the weights), spread over the forwards and backwards; zero2 once."""
    plan = plan_from_job(spec).with_(precision=precision)   # dp=2
    m = plan.num_microbatches
    rep = calibrated_inputs(spec, plan, unit_profile)
    z3 = calibrated_inputs(spec, plan.with_(sharding="zero3"), unit_profile)
    z2 = calibrated_inputs(spec, plan.with_(sharding="zero2"), unit_profile)
    cost = CostModel(spec.model, precision=precision)
    units = plan.stages[0].units                # embedding + blocks: one group per block and the root
    blocks = [u for u in units if u > 0]
    fit = unit_profile["runtime"]["allreduce"]["2"]
    # an all-gather of B bytes moves half of what an all-reduce of B does
    gather = sum(fit["alpha_s"] + param_bytes * cost.stage_params([u]) * fit["per_byte_s"] / 2 for u in blocks) \
        + fit["alpha_s"] + param_bytes * cost.stage_params([0]) * fit["per_byte_s"] / 2
    per_op = gather * (m + 1) / (2 * m)         # m forwards and m backwards share the m+1 gathers
    assert z3.stage_costs[0].forward - rep.stage_costs[0].forward == pytest.approx(per_op)
    assert z3.stage_costs[0].backward - rep.stage_costs[0].backward == pytest.approx(per_op)
    assert z2.stage_costs[0].forward - rep.stage_costs[0].forward == pytest.approx(gather / m)
    assert z2.stage_costs[0].backward == pytest.approx(rep.stage_costs[0].backward)


def test_a_measured_slowdown_scales_its_stage_compute(spec, unit_profile):
    plan = plan_from_job(spec).with_(dp=1)
    even, _ = predict(spec, plan, unit_profile, iterations=2, rank_slowdown={0: 1.0, 1: 1.0})
    slow, det = predict(spec, plan, unit_profile, iterations=2, rank_slowdown={0: 2.0, 1: 1.0})
    assert det["contention_factors"] == [2.0, 1.0] and det["contention_measured"]

    def fwd(res, rank):
        return min(e.duration for e in res.trace.events if e.kind == "forward" and e.rank == rank)

    assert fwd(slow, 0) == pytest.approx(2 * fwd(even, 0))
    assert fwd(slow, 1) == pytest.approx(fwd(even, 1))


def test_zero_bubble_split_follows_the_runtime(spec, unit_profile):
    plan = plan_from_job(spec).with_(dp=1, schedule="zb-h1")
    prof = {**unit_profile, "runtime": {**unit_profile["runtime"], "split_backward": {"input": 0.9, "weight": 0.8}}}
    inp = calibrated_inputs(spec, plan, prof)
    first, last = inp.stage_costs
    # The first stage sends no input gradient: its whole backward runs at W.
    assert first.backward_input < 0.05 * first.backward          # the interpreter's own time only
    assert first.backward_weight == pytest.approx(first.backward, rel=0.05)
    # Elsewhere the measured split: B_input and W cost 0.9 and 0.8 of one backward (plus overheads).
    full = last.backward
    assert last.backward_input == pytest.approx(0.9 * full, rel=0.05)
    assert last.backward_weight == pytest.approx(0.8 * full, rel=0.05)


def test_wan_off_predicts_no_wan_and_shaper_adds_the_message_overhead(spec, unit_profile):
    plan = plan_from_job(spec).with_(dp=1)
    prof = {**unit_profile, "runtime": {**unit_profile["runtime"], "wan_message_overhead_s": 2e-3}}
    off = calibrated_inputs(spec, plan, prof, mode="off").cluster.wan_links[0]
    shaped = calibrated_inputs(spec, plan, prof, mode="shaper").cluster.wan_links[0]
    assert off.latency_ms == pytest.approx(0.1)          # the measured gloo p2p latency (100 us)
    assert shaped.latency_ms == pytest.approx(5 + 2)
    t_off = predict(spec, plan, prof, iterations=2, mode="off")[0].metrics.iteration_time
    t_wan = predict(spec, plan, prof, iterations=2, mode="shaper")[0].metrics.iteration_time
    assert t_wan > t_off + 2 * 5e-3


def _metrics(it: float, busy: dict[int, float], bubbles, iterations: int = 2) -> Metrics:
    return Metrics(iteration_time=it, tokens_per_s=1.0, busy_fraction=busy, mean_utilization=0.0, bubbles=bubbles,
                   link_utilization={}, wan_bytes=0, iterations=iterations)


def test_comparison_arithmetic():
    pred = _metrics(0.110, {0: 0.5, 1: 0.7}, [(0, 0.0, 0.02), (1, 0.0, 0.04)])
    meas = _metrics(0.100, {0: 0.4, 1: 0.8}, [(0, 0.0, 0.05), (1, 0.1, 0.13)])
    row = compare_case("c", "desc", pred, meas)
    assert row.iteration_error == pytest.approx(0.10)
    assert row.busy_error_pp == pytest.approx(10.0)
    assert row.predicted_bubble_s == pytest.approx(0.03)         # (0.02 + 0.04) / 2 iterations
    assert row.measured_bubble_s == pytest.approx(0.04)
    assert row.bubble_error == pytest.approx(-0.25)
    worse = compare_case("d", "desc", _metrics(0.08, {0: 0.5}, []), _metrics(0.1, {0: 0.5}, []))
    s = summarize([row, worse])
    assert s["mean_abs_iteration_error"] == pytest.approx(0.15)
    assert s["worst_abs_iteration_error"] == pytest.approx(0.20)
    table = markdown_table([row, worse])
    assert "| c | desc | 110.0 / 100.0 | +10.0% |" in table
    assert "worst 20.0%" in table
    assert math.isnan(rel_error(1.0, 0.0))


def test_drop_warmup_keeps_later_iterations():
    t = Trace(events=[Event(rank=0, kind="forward", start=i, end=i + 0.5, iteration=i) for i in (1, 2, 3, 4)],
              num_ranks=1)
    kept = drop_warmup(t, 2)
    assert [e.iteration for e in kept.events] == [3, 4]
    with pytest.raises(ValueError):
        drop_warmup(t, 4)


def test_message_overhead_follows_the_probed_latency_curve_and_queued_messages_pay_the_gap(spec, unit_profile):
    """The calibration run's overhead (at its link's 5 ms) is the level; the probe's curve gives the
    change with latency; the probe's back-to-back gap becomes link time, taken off the overhead."""
    from geotrain.calibrate.calibrated_links import message_overhead_s

    rt = {**unit_profile["runtime"], "wan_message_overhead_s": 2e-3,
          "calibration_run": {**unit_profile["runtime"].get("calibration_run", {}), "latency_ms": 5.0},
          "wan_messages": {"bytes": 32768, "gap_s": 0.25e-3,
                           "overhead_s": {"2": 0.5e-3, "10": 1.5e-3, "40": 2.5e-3}}}
    prof = {**unit_profile, "runtime": rt}
    # probe(5 ms) = 0.5 + 3/8 * 1.0 = 0.875 ms, so the run's hand-offs cost 2 / 0.875 of the probe's.
    ratio = 2e-3 / 0.875e-3
    for lat, probe in ((5, 0.875e-3), (2, 0.5e-3), (25, 2.0e-3), (80, 2.5e-3)):
        extra, gap = message_overhead_s(prof, lat)
        assert gap == pytest.approx(0.25e-3 * ratio)
        assert extra + gap == pytest.approx(probe * ratio)
    # Without the probe (older profiles) the calibration run's value is used at every latency.
    old = {**unit_profile, "runtime": {**unit_profile["runtime"], "wan_message_overhead_s": 2e-3}}
    assert message_overhead_s(old, 40) == (pytest.approx(2e-3), 0.0)
    # The gap lowers the link's rate for boundary tensors: a back-to-back burst takes longer.
    plan = plan_from_job(spec).with_(dp=1)
    link = calibrated_inputs(spec, plan, prof, mode="shaper").cluster.wan_links[0]
    lp = plan.link_between(*link.between)
    wire = {"fp32": 4, "bf16": 2, "fp16": 2}[plan.precision]          # boundary tensors travel in the training dtype
    stripe = wire * plan.micro_batch * spec.model.seq_len * spec.model.hidden / (max(1, lp.connections) if lp else 1)
    base = spec.cluster.wan_links[0]
    per_msg = stripe / (link.per_connection_gbps * 1e9 / 8)       # the stripes cross side by side
    assert per_msg == pytest.approx(stripe / (base.per_connection_gbps * 1e9 / 8) + 0.25e-3 * ratio)
    assert link.latency_ms == pytest.approx(5 + 1e3 * (2e-3 - 0.25e-3 * ratio))


def test_validate_sim_passes_its_wan_mode_on(monkeypatch, tmp_path):
    import geotrain.calibrate.validation_run as validate
    from geotrain.cli import main

    seen = {}

    def fake_run_validation(out, **kw):
        seen.update(kw)
        return [], "table"

    monkeypatch.setattr(validate, "run_validation", fake_run_validation)
    assert main(["validate-sim", "--out", str(tmp_path), "--wan", "kernel", "--case", "base"]) == 0
    assert seen["modes"] == ["kernel"] and seen["only"] == ["base"] and seen["runs"] == 1
    assert main(["validate-sim", "--out", str(tmp_path), "--runs", "3"]) == 0
    assert seen["modes"] == ["kernel", "shaper"] and seen["runs"] == 3      # kernel is the headline


@pytest.mark.parametrize("edit, reason", [
    (lambda d: d.pop("format") and d.pop("version"), "older geotrain"),
    (lambda d: d.update(version=7), "profile version 7"),
    (lambda d: d.update(format="someone-elses"), "not a geotrain profile"),
    (lambda d: d.update(block={"2": [0.1, -1.0]}), "block.2.1"),
    (lambda d: d.update(extra_table={}), "extra_table"),
])
def test_old_foreign_or_malformed_profiles_are_one_line_errors(tmp_path, unit_profile, edit, reason, capsys):
    import json

    from geotrain.cli import main

    path = tmp_path / "profile.json"
    save_profile(unit_profile, path)
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"]) == ("geotrain-profile", 1)
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(GeotrainError, match=reason):
        load_profile(path)
    assert main(["train", "examples/tiny_2dc.toml", "--profile", str(path), "--steps", "1", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and reason in err[0], err
    assert not (tmp_path / "run").exists()


def test_validation_tables_summarize_every_run_and_the_headline_mode():
    from geotrain.calibrate.case_rows import CaseRow
    from geotrain.calibrate.tables import stats, validation_markdown

    def row(case, pred, meas, bp, bm):
        return CaseRow(case, "d", pred, meas, {0: 0.5}, {0: 0.5}, bp, bm, {0: bp / 2, 1: bp / 2},
                       {0: bm / 2, 1: bm / 2}, posthoc_iteration_s=meas)

    det = {"background_runnable": 0.5}
    run1 = {"kernel": {"rows": [row("a", 1.1, 1.0, 0.5, 0.5), row("b", 0.9, 1.0, 0.6, 0.5)],
                       "details": {"a": {**det, "compute_ratio": 1.25}, "b": det}},
            "shaper": {"rows": [row("a", 1.0, 1.0, 0.5, 0.5), row("b", 1.0, 1.0, 0.5, 0.5)],
                       "details": {"a": det, "b": det}}}
    run2 = {"kernel": {"rows": [row("a", 1.0, 1.0, 0.5, 0.5), row("b", 1.3, 1.0, 0.5, 0.5)],
                       "details": {"a": det, "b": det}}}
    st = stats(run1["kernel"]["rows"] + run2["kernel"]["rows"])
    assert st["iteration_mean"] == pytest.approx((0.1 + 0.1 + 0.0 + 0.3) / 4)
    assert st["iteration_worst"] == pytest.approx(0.3) and st["bubble_worst"] == pytest.approx(0.2)
    assert st["posthoc_worst"] == 0.0
    md = validation_markdown([run1, run2], ("kernel", "shaper"), {"cores": 2, "cpu": "x", "steps": 6, "warmup": 2,
                                                                 "wall_s": 1.0, "other_mode_runs": 1})
    assert "| 2 | 15.0 / 30.0 | - |" in md                   # run 2: kernel only
    assert "| **all** | 12.5 / 30.0 | 0.0 / 0.0 |" in md
    assert "mean |iteration-time error| 12.5%, worst 30.0%" in md
    assert "| a | d | 1100.0 / 1000.0 | 1000.0 / 1000.0 | +10.0% / +0.0% |" not in md   # one prediction per case
    assert "| a | d | 1100.0 | 1000.0 / 1000.0 | +10.0% / +0.0% |" in md
    assert "| +0.0% / +0.0% | 1.25 / - |" in md            # case a's compute ratio per run (run 2 has none)


def test_the_report_compares_a_run_in_steady_state():
    from geotrain.report.compare import steady_state

    evs = [Event(rank=0, kind="forward", start=it, end=it + (0.9 if it <= 2 else 0.1), iteration=it)
           for it in range(1, 7)]
    trace = Trace(events=evs, num_ranks=1)
    assert sorted({e.iteration for e in steady_state(trace).events}) == [3, 4, 5, 6]
    short = Trace(events=evs[:3], num_ranks=1)
    assert steady_state(short) is short                     # too few iterations: nothing left out


def test_the_calibration_runs_residual_slowdown_multiplies_processor_sharing(spec, unit_profile):
    one = plan_from_job(spec).with_(dp=1)               # 2 ranks on 2 cores: no oversubscription
    cal = {"background_runnable": 0.0, "background_effective": 1.0, "sharing_residual": 1.05}
    prof = {**unit_profile, "runtime": {**unit_profile["runtime"], "calibration_run": cal}}
    _, det = predict(spec, one, prof, iterations=2)
    assert det["contention_factors"] == pytest.approx([1.05, 1.05])
    # A profile without it: the additive "effective background" (what older profiles hold).
    old = {**unit_profile, "runtime": {**unit_profile["runtime"],
                                       "calibration_run": {"background_runnable": 0.0, "background_effective": 1.0}}}
    _, det_old = predict(spec, one, old, iterations=2)
    assert all(f > 1.05 for f in det_old["contention_factors"])


def test_a_sampled_background_the_ranks_did_not_feel_is_not_charged(spec, unit_profile):
    """A calibration run sampled during a burst of many runnable threads (few sessions under
    autogroup) whose ranks measured little slow-down: its predictions use the background that
    reproduces the measured slow-down, not the sampled count."""
    one = plan_from_job(spec).with_(dp=1)
    burst = {"background_runnable": 20.0, "background_effective": 0.5, "sharing_residual": 1.0}
    felt = {"background_runnable": 0.5, "background_effective": 0.5, "sharing_residual": 1.0}
    dets = [predict(spec, one, {**unit_profile, "runtime": {**unit_profile["runtime"], "calibration_run": c}},
                    iterations=2)[1] for c in (burst, felt)]
    assert dets[0]["contention_factors"] == pytest.approx(dets[1]["contention_factors"])
    assert max(dets[0]["contention_factors"]) < 2.0
