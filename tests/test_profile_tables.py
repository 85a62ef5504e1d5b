"""Measured profiles indexed by (micro-batch, tp): interpolation at and between the measured points,
the cost model taking per-GPU times (TP collectives inside) and measured saved bytes from them, and
`geotrain plan` / `geotrain simulate` accepting such a table (issue #27 item 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geotrain.costs import CostModel
from geotrain.costs.activations import stage_input_bytes
from geotrain.costs.unit_times import Profile, parse_key, table_key
from geotrain.models.presets import PRESETS
from geotrain.spec.cluster import BUILTIN_GPU_TYPES, Datacenter
from tests._cli import geotrain

GPU_RUNS = Path(__file__).resolve().parents[1] / "bench" / "data" / "gpu_runs"
CPU = BUILTIN_GPU_TYPES["cpu"]
DC = Datacenter(name="dc", gpu_type="cpu", gpus=8, gpus_per_node=4)

# block: tp 1 at micro-batches 1 and 4, tp 4 at 1 and 4 (with saved bytes); head: tp 1 only
TABLE = {
    "block": {"1": [0.010, 0.020, 100.0], "4": [0.040, 0.080, 400.0],
              "1,4": [0.004, 0.008, 30.0], "4,4": [0.012, 0.024, 120.0]},
    "head": {"1": [0.002, 0.004], "2": [0.004, 0.008]},
}


def test_table_keys_round_trip():
    assert table_key(8) == "8" and table_key(8, 4) == "8,4"
    assert parse_key("8") == (8, 1) and parse_key("8,4") == (8, 4) and parse_key(3) == (3, 1)
    for bad in ("x", "8,", "0,4", "8,0", "1,2,3"):
        with pytest.raises(ValueError):
            parse_key(bad)


def test_values_at_and_between_the_measured_points():
    p = Profile(TABLE)
    assert p.times("block", 4, 4) == pytest.approx((0.012, 0.024))          # a measured point
    assert p.times("block", 2, 4) == pytest.approx((0.004 + (0.012 - 0.004) / 3, 0.008 + (0.024 - 0.008) / 3))
    # between tp 1 and tp 4: linear in 1/tp, weight (1/2 - 1) / (1/4 - 1) = 2/3 towards tp 4
    w = (1 / 2 - 1) / (1 / 4 - 1)
    assert p.times("block", 1, 2) == pytest.approx((0.010 + w * (0.004 - 0.010), 0.020 + w * (0.008 - 0.020)))
    # between in both: each tp's table at micro-batch 2, then across tp
    t1, t4 = 0.010 + (0.040 - 0.010) / 3, 0.004 + (0.012 - 0.004) / 3
    assert p.times("block", 2, 2)[0] == pytest.approx(t1 + w * (t4 - t1))
    # beyond the widest measured tp: scaled by 4 / 8; a tp-1-only kind: time / tp (the old rule)
    assert p.times("block", 4, 8) == pytest.approx((0.006, 0.012))
    assert p.times("head", 2, 4) == pytest.approx((0.001, 0.002))
    assert p.activation_bytes("block", 2, 4) == pytest.approx(30 + 90 / 3)
    assert p.activation_bytes("head", 1) is None
    assert p.includes_tp_comm("block", 2) and not p.includes_tp_comm("block", 1)
    assert not p.includes_tp_comm("head", 4)


def test_the_cost_model_takes_per_gpu_times_and_saved_bytes_at_tp():
    spec = PRESETS["tiny"]
    cost = CostModel(spec, precision="fp32", profile=TABLE)
    t = cost.stage_times([1, 2], CPU, 4, tp=4)
    assert (t.forward, t.backward) == pytest.approx((0.024, 0.048))        # per GPU, not divided by tp again
    assert cost.tp_comm_time([1, 2], 4, 4, DC) == 0                          # the collectives are in the times
    assert cost.microbatch_activation_bytes([1, 2], 4, tp=4) == pytest.approx(2 * 120 + stage_input_bytes(spec, 4))
    flops = CostModel(spec, precision="fp32")
    assert flops.stage_times([1], CPU, 4, tp=4).forward == pytest.approx(flops.stage_times([1], CPU, 4).forward / 4)
    assert flops.tp_comm_time([1, 2], 4, 4, DC) > 0
    tp1 = CostModel(spec, precision="fp32", profile={"block": {"1": [0.01, 0.02]}})
    assert tp1.tp_comm_time([1, 2], 1, 4, DC) == flops.tp_comm_time([1, 2], 1, 4, DC)   # measured at tp 1 only
    assert tp1.stage_times([1], CPU, 1, tp=4).forward == pytest.approx(0.0025)
    # under checkpointing the kept bytes stay derived
    full = CostModel(spec, precision="fp32", checkpointing="full", profile=TABLE)
    assert full.microbatch_activation_bytes([1], 4, tp=4) == CostModel(spec, precision="fp32", checkpointing="full") \
        .microbatch_activation_bytes([1], 4, tp=4)


@pytest.mark.parametrize("bad", [{"block": {"1,4": [0.1]}}, {"block": {"a": [0.1, 0.2]}},
                                 {"block": {"1": [0.1, 0.2, 5.0], "2": [0.1, 0.2]}},
                                 {"block": {"1": [0.1, -0.2]}}, {"block": [0.1, 0.2]}])
def test_bad_tables_are_refused(bad):
    with pytest.raises(ValueError):
        Profile(bad)


def _tiny_spec(tmp_path):
    (tmp_path / "cluster.toml").write_text('''name = "one"
[[datacenters]]
name = "a"
gpu_type = "a100-80g"
gpus = 8
gpus_per_node = 4
''')
    (tmp_path / "spec.toml").write_text('''name = "prof"
cluster = "cluster.toml"
model = "tiny"
[job]
global_batch = 16
micro_batch = 2
precision = "fp32"
pp = 2
dp = 1
tp = 2
''')
    return tmp_path / "spec.toml"


def test_plan_and_simulate_accept_a_measured_table(tmp_path, capfd):
    spec = _tiny_spec(tmp_path)
    table = {"embedding": {"2,2": [0.001, 0.001]}, "block": {"1,2": [0.02, 0.04], "4,2": [0.05, 0.10]},
             "head": {"2,2": [0.003, 0.006]}}
    (tmp_path / "table.json").write_text(json.dumps(table))
    rc, out, err = geotrain(capfd, "plan", spec, "--profile", tmp_path / "table.json", "--out", tmp_path / "p.json")
    assert rc == 0, err
    rc, out, err = geotrain(capfd, "simulate", tmp_path / "p.json", "--profile", tmp_path / "table.json", "--out",
                            tmp_path / "sim", "--no-compare", "--no-progress", "--no-timeline")
    assert rc == 0, err
    metrics = json.loads((tmp_path / "sim" / "metrics.json").read_text())
    rc, _, err = geotrain(capfd, "simulate", tmp_path / "p.json", "--out", tmp_path / "flops", "--no-compare",
                          "--no-progress", "--no-timeline")
    assert rc == 0, err
    flops = json.loads((tmp_path / "flops" / "metrics.json").read_text())
    it = metrics["iteration_time_s"]
    base = flops["iteration_time_s"]
    # a block at micro-batch 2, tp 2 costs 0.03 + 0.06 s (interpolated): far above the FLOP estimate
    assert it > 10 * base
    (tmp_path / "bad.json").write_text(json.dumps({"block": {"2,x": [0.1, 0.2]}}))
    rc, _, err = geotrain(capfd, "simulate", tmp_path / "p.json", "--profile", tmp_path / "bad.json", "--out",
                          tmp_path / "bad", "--no-compare", "--no-progress")
    assert rc == 2 and "MICRO_BATCH,TP" in err and "Traceback" not in err


def test_a_peers_profile_is_imported(tmp_path, capfd):
    """`geotrain profile --import-sailor`: Sailor's per-layer profile (the gpu_runs folder) as a table
    per (micro-batch, tp), on the GPU it was measured on; a last layer without the LM head is not a head."""
    sailor = json.loads((GPU_RUNS / "profiles.json").read_text())["profiles"]
    out = tmp_path / "neo.json"
    rc, _, err = geotrain(capfd, "profile", "--import-sailor", GPU_RUNS, "--model", "GPT-Neo-2.7", "--gpu", "A100-40",
                          "--out", out)
    assert rc == 0, err
    table = json.loads(out.read_text())
    assert set(table) >= {"embedding", "block"} and "head" not in table     # layer 33 is the final norm alone
    assert table["memory_bytes_per_s"] == 1.555e12
    e = next(x for x in sailor["GPT-Neo-2.7"]["A100-40"] if (x["mbs"], x["tp"]) == (8, 4))
    cost = CostModel(PRESETS["tiny"], precision="fp32", profile=table)
    t = cost.stage_times([1], BUILTIN_GPU_TYPES["a100-40g"], 8, tp=4)       # measured there: no scaling
    assert (t.forward, t.backward) == pytest.approx((sum(e["fwd_s"][1:33]) / 32, sum(e["bwd_s"][1:33]) / 32))
    h100 = cost.stage_times([1], BUILTIN_GPU_TYPES["h100-80g"], 8, tp=4).forward
    a100, h100_type = BUILTIN_GPU_TYPES["a100-40g"], BUILTIN_GPU_TYPES["h100-80g"]    # another GPU: by achieved FLOP/s
    assert h100 == pytest.approx(t.forward * a100.achieved_flops("fp32") / h100_type.achieved_flops("fp32"))
    assert h100 < t.forward / 1.5
    rc, _, err = geotrain(capfd, "profile", "--import-sailor", GPU_RUNS, "--model", "OPT-350", "--gpu", "GH-96",
                          "--out", tmp_path / "opt.json")
    assert rc == 0, err
    assert "head" in json.loads((tmp_path / "opt.json").read_text())        # OPT's layer 25 holds the LM head
    rc, _, err = geotrain(capfd, "profile", "--import-sailor", GPU_RUNS, "--model", "OPT-350", "--gpu", "H100",
                          "--out", tmp_path / "x.json")
    assert rc == 2 and "A100-40, GH-96" in err and "Traceback" not in err
