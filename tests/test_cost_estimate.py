"""`geotrain estimate`: tables whose numbers are the cost model's, and clean errors."""

import json

from geotrain.cli import main
from geotrain.console import human_bytes, human_rate, human_seconds
from geotrain.costs import CostModel
from geotrain.planner.manual import plan_from_job
from geotrain.spec.load import load_spec


def _run(capsys, *argv):
    rc = main(["estimate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_estimate_tiny_default(capsys, examples_dir):
    path = examples_dir / "tiny_2dc.toml"
    rc, out, err = _run(capsys, str(path))
    assert rc == 0, err
    spec = load_spec(path)
    plan = plan_from_job(spec)
    cost = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing)
    mb = plan.micro_batch
    for header in ("Per unit", "fwd FLOP", "saved/mb", "Per stage", "DP sync", "GPU memory", "fits"):
        assert header in out
    for kind in ("embedding", "block x2", "head"):
        assert kind in out
    # the per-unit numbers are the cost model's
    f, b = cost.unit_flops(1, mb)
    assert human_rate(f, "FLOP") in out and human_rate(b, "FLOP") in out
    assert human_bytes(cost.unit_activation_bytes(1, mb)) in out
    # one row per stage, in its DC, each fitting in the emulated 4 GiB "GPU"
    lines = out.splitlines()
    for s, st in enumerate(plan.stages):
        t = cost.stage_times(st.units, spec.cluster.gpu("cpu"), mb)
        row = next(ln for ln in lines if ln.split()[:3] == [str(s), f"{st.units[0]}-{st.units[-1]}", st.dc])
        assert human_seconds(t.forward) in row and human_seconds(t.backward) in row
    memory_rows = [ln for ln in lines if ln.rstrip().endswith(("yes", "NO"))]
    assert len(memory_rows) == plan.pp and all(r.rstrip().endswith("yes") for r in memory_rows)
    assert "all stages fit" in out


def test_estimate_reports_a_stage_that_does_not_fit(capsys, tmp_path, examples_dir):
    spec_file = tmp_path / "big_batch.toml"
    spec_file.write_text(f"""
cluster = "{examples_dir / 'clusters' / 'tiny_2dc.toml'}"
model = "small"
[job]
global_batch = 512
micro_batch = 256
precision = "fp32"
checkpointing = "none"
sharding = "replicate"
schedule = "gpipe"
pp = 2
dp = 2
""")
    spec = load_spec(spec_file)
    cost = CostModel(spec.model, precision="fp32")
    need = cost.stage_memory(range(0, 4), spec.cluster.gpu("cpu"), 256, 1, "replicate", 2).total
    assert need > spec.cluster.gpu("cpu").memory_bytes  # the premise: one micro-batch alone is too big
    rc, out, err = _run(capsys, str(spec_file))
    assert rc == 0, err
    assert "NO" in out and "do NOT fit" in out


def test_estimate_with_a_profile(capsys, tmp_path, examples_dir):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"block": {"2": [0.0123, 0.0246]}}))
    rc, out, _ = _run(capsys, str(examples_dir / "tiny_2dc.toml"), "--profile", str(prof))
    assert rc == 0
    assert "measured profile" in out and "12.3 ms" in out and "24.6 ms" in out


def test_estimate_errors_are_one_line(capsys, tmp_path, examples_dir):
    rc, out, err = _run(capsys, str(tmp_path / "missing.toml"))
    assert rc == 2 and "missing.toml" in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"blocks": {}}))
    rc, out, err = _run(capsys, str(examples_dir / "tiny_2dc.toml"), "--profile", str(bad))
    assert rc == 2 and "profile" in err and len(err.strip().splitlines()) == 1
    bad.write_text("{not json")
    rc, out, err = _run(capsys, str(examples_dir / "tiny_2dc.toml"), "--profile", str(bad))
    assert rc == 2 and "JSON" in err and len(err.strip().splitlines()) == 1
