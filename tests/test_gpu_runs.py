"""The published GPU runs as geotrain inputs (calibrate.gpu_runs) and their validation table
(calibrate.gpu_validation): every run's plan converted, the profile imported, predictions made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geotrain.calibrate.gpu_runs import (
    curve_time,
    load_gpu_runs,
    node_link,
    padded_vocab,
    run_plan,
    sailor_profile,
    write_run_spec,
)
from geotrain.calibrate.gpu_table import goal_line, gpu_markdown
from geotrain.calibrate.gpu_validation import validate_gpu_runs
from geotrain.costs import CostModel
from geotrain.errors import GeotrainError
from geotrain.layout.plan_check import check_plan_for_spec
from tests._cli import geotrain

DATA = Path(__file__).resolve().parents[1] / "bench" / "data" / "gpu_runs"


@pytest.fixture(scope="module")
def data():
    return load_gpu_runs(DATA)


def test_every_run_converts_to_its_plan(data, tmp_path):
    assert len(data.runs) == 15
    for run in data.runs:
        plan = run_plan(run)
        layers = [tuple(s["layers"]) for s in run["stages"]]
        assert plan.pp == run["pp"] == len(layers)
        assert [(st.units[0], st.units[-1]) for st in plan.stages] == layers      # Sailor layer i = unit i
        assert [u for st in plan.stages for u in st.units] == list(range(26))
        assert (plan.dp, plan.tp, plan.micro_batch) == (run["dp"], run["tp"], run["mbs"])
        assert plan.num_microbatches == run["microbatches_per_replica"]
        assert plan.global_batch == run["gbs"] and plan.num_ranks == run["nodes"] * run["gpus_used_per_node"]
        assert (plan.schedule, plan.precision, plan.sharding, plan.checkpointing) == ("1f1b", "fp32", "replicate",
                                                                                      "none")
        spec = write_run_spec(data, run, tmp_path / run["id"].rsplit("/", 1)[-1])
        check_plan_for_spec(spec, plan)                       # what `geotrain simulate` checks
        assert spec.model.num_units == 26 and spec.model.vocab == padded_vocab(data, "OPT-350", run["tp"])
        assert spec.cluster.total_gpus == run["nodes"] * 4 and spec.job.optimizer == "adamw"


def test_the_profile_is_sailors_per_layer_times(data, tmp_path):
    prof = sailor_profile(data, "OPT-350", "GH-96")
    entries = data.profiles["OPT-350"]["GH-96"]
    act = data.models["OPT-350"]["llm_info_per_layer"]
    for e in entries:
        key = str(e["mbs"]) if e["tp"] == 1 else f"{e['mbs']},{e['tp']}"
        assert prof["embedding"][key][:2] == [e["fwd_s"][0], e["bwd_s"][0]]
        assert prof["head"][key][:2] == [e["fwd_s"][25], e["bwd_s"][25]]
        assert prof["block"][key][0] == pytest.approx(sum(e["fwd_s"][1:25]) / 24)
        saved = act[str(e["tp"])]["act_mem_floats"]
        assert prof["block"][key][2] == pytest.approx(4 * e["mbs"] * sum(saved[1:25]) / 24)
    # a one-stage run's compute is exactly the profile's sum over its layers
    run = next(r for r in data.runs if r["pp"] == 1)
    spec = write_run_spec(data, run, tmp_path)
    cost = CostModel(spec.model, precision="fp32", profile=prof)
    e = next(x for x in entries if (x["mbs"], x["tp"]) == (run["mbs"], run["tp"]))
    t = cost.stage_times(range(26), spec.cluster.gpu("gh200-96g"), run["mbs"], run["tp"])
    assert (t.forward, t.backward) == pytest.approx((sum(e["fwd_s"]), sum(e["bwd_s"])))
    assert cost.tp_comm_time(range(26), run["mbs"], run["tp"], spec.cluster.datacenters[0]) == 0


def test_the_node_link_is_the_one_pair_curve(data):
    rate, latency = node_link(data)
    coeffs = data.cluster["inter_node"]["GH-96"]["GH-96"]["n=1->1"]["coeffs"]
    for size in (2e6, 8e6, 67e6, 400e6, 1e9):       # the runs' messages (2-400 MB): within 7 % of the curve
        assert latency + size / rate == pytest.approx(curve_time(coeffs, size), rel=0.07)
    assert 22e9 < rate < 23e9 and 40e-6 < latency < 60e-6


def test_predictions_and_table(data, tmp_path):
    v = validate_gpu_runs(data, tmp_path)
    s = v.summary()
    assert s["runs"] == 15 and all(r.excluded is None for r in v.rows)
    assert all(r.p2p == "blocking" and r.predicted_s > 0 and r.overlapped_s > 0 for r in v.rows)
    n4 = next(r for r in v.rows if r.run.startswith("N4_pp1_dp4"))
    assert n4.measured_grad_s is None and "SUSPECT[grad_reduction_s]" in n4.notes   # the flagged field is dropped
    assert next(r for r in v.rows if r.run.startswith("N32_pp4")).earlier_mem is None   # a copied value
    assert all(r.predicted_grad_s == 0 for r in v.rows if r.run.startswith(("N1_", "N2_pp2", "N4_pp4")))  # dp 1
    md = gpu_markdown(v)
    assert md.count("\n| N") == 15 and "Sailor's simulator" in md
    goal = goal_line(v)                                   # the verdict leads the table, the runs outside named
    assert md.startswith(goal) and all(r.run in goal for r in v.rows if abs(r.error) > 0.10)
    assert ("iteration worst NOT met" in goal) == (s["iteration_worst"] > 0.10)
    assert (tmp_path / "N8_pp4_dp2_tp4_mbs8_gbs512" / "plan.json").exists()
    assert json.loads((tmp_path / "profile-OPT-350-GH-96.json").read_text())["block"]


def test_a_suspect_run_is_left_out_with_its_flag(data, tmp_path):
    runs = [dict(r) for r in data.runs]
    runs[0] = {**runs[0], "flags": runs[0]["flags"] + ["SUSPECT[run]: made up for this test"]}
    v = validate_gpu_runs(type(data)(runs, data.profiles, data.models, data.cluster, data.setup, data.directory),
                          tmp_path)
    assert v.rows[0].excluded == "SUSPECT[run]" and v.summary()["runs"] == 14
    assert "left out: SUSPECT[run]" in gpu_markdown(v)


def test_command_line(tmp_path, capfd):
    rc, out, err = geotrain(capfd, "validate-sim", "--gpu-runs", DATA, "--out", tmp_path)
    assert rc == 0, err
    assert (tmp_path / "GPU_VALIDATION.md").exists() and "iteration mean" in out
    plan = tmp_path / "gpu_runs" / "N2_pp2_dp1_tp4_mbs8_gbs32" / "plan.json"
    prof = tmp_path / "gpu_runs" / "profile-OPT-350-GH-96.json"
    rc, out, err = geotrain(capfd, "simulate", plan, "--p2p", "blocking", "--profile", prof, "--out", tmp_path / "s",
                            "--no-compare", "--no-progress", "--no-timeline")
    assert rc == 0, err
    row = next(r for r in json.loads((tmp_path / "gpu_results.json").read_text())["rows"]
               if r["run"] == "N2_pp2_dp1_tp4_mbs8_gbs32")
    sim = json.loads((tmp_path / "s" / "metrics.json").read_text())
    assert sim["iteration_time_s"] == pytest.approx(row["predicted_s"])     # the table's number, repeated
    rc, _, err = geotrain(capfd, "validate-sim", "--gpu-runs", tmp_path / "nothing", "--out", tmp_path / "x")
    assert rc == 2 and "not a directory" in err and "Traceback" not in err
    with pytest.raises(GeotrainError, match="missing"):
        load_gpu_runs(tmp_path)
