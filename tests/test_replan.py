"""geotrain replan: a new plan for the cluster a run has left, and one-line refusals.

No training here: a run directory is what `geotrain train` leaves for replan to read, its
plan.json (written with the trainer's own save_plan).
"""

from __future__ import annotations

import json
from pathlib import Path

from geotrain.cli import main
from geotrain.layout.plan import load_plan, save_plan
from geotrain.planner.manual import plan_from_job
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"

NOFIT = """
name = "nofit"
model = "tiny"

[cluster.gpu_types.small]
bf16_tflops = 1
fp16_tflops = 1
fp32_tflops = 1
memory_gib = 0.0025

[[cluster.datacenters]]
name = "a"
gpu_type = "small"
gpus = 1

[[cluster.datacenters]]
name = "b"
gpu_type = "small"
gpus = 1

[[cluster.wan_links]]
between = ["a", "b"]
latency_ms = 10
capacity_gbps = 1
per_connection_gbps = 0.5

[job]
global_batch = 4
micro_batch = 1
precision = "fp32"
pp = 2
"""


def _run_dir(tmp_path: Path, spec_path: Path, **overrides) -> Path:
    run = tmp_path / "run"
    spec = load_spec(spec_path)
    plan = plan_from_job(spec).with_(**overrides)
    save_plan(run / "plan.json", plan, spec=spec)      # as the trainer writes it: the spec embedded
    return run


def test_replan_without_a_dc_keeps_the_batch_and_reports_the_change(tmp_path: Path, capsys) -> None:
    run = _run_dir(tmp_path, SPEC, precision="fp32")
    assert main(["replan", str(run), "--without", "west"]) == 0
    out = capsys.readouterr().out
    plan, doc = load_plan(run / "replan.json")
    assert {st.dc for st in plan.stages} == {"east"}
    assert plan.global_batch == 16 and plan.precision == "fp32"   # what the run trained stays
    assert [u for st in plan.stages for u in st.units] == list(range(6))
    assert plan.dp * plan.pp <= 2 and not plan.links
    assert doc["replan"]["dropped"] == ["west"] and Path(doc["spec"]) == SPEC.resolve()
    assert [d["name"] for d in doc["resolved_spec"]["cluster"]["datacenters"]] == ["east"]   # what is left
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "pp 2 x dp 2" in lines["layout"] and f"pp {plan.pp} x dp {plan.dp}" in lines["layout"]
    assert "east 2, west 2" in lines["GPUs"]
    assert "east<->west" in lines["links"] and lines["links"].rstrip().endswith("none")
    assert lines["iteration"].count("(simulated)") == 2
    assert f"geotrain train {run / 'replan.json'} --resume-from {run}" in out


def test_replan_with_fewer_gpus_uses_what_is_left(tmp_path: Path, capsys) -> None:
    run = _run_dir(tmp_path, SPEC)
    assert main(["replan", str(run), "--gpus", "east=1", "--out", str(tmp_path / "p.json")]) == 0
    plan, _ = load_plan(tmp_path / "p.json")
    used = plan.gpus_per_dc()
    assert used.get("east", 0) <= 1 and used.get("west", 0) <= 2 and plan.global_batch == 16
    assert "east 2, west 2" in capsys.readouterr().out


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_impossible_requests_are_one_line_errors(tmp_path: Path, capsys) -> None:
    run = _run_dir(tmp_path, SPEC)
    assert "unknown datacenter 'mars'" in _one_line_error(capsys, ["replan", str(run), "--without", "mars"])
    assert "nothing is left" in _one_line_error(capsys, ["replan", str(run), "--without", "east", "--gpus", "west=0"])
    assert "say what changed" in _one_line_error(capsys, ["replan", str(run)])
    assert "DC=N" in _one_line_error(capsys, ["replan", str(run), "--gpus", "east=two"])
    assert "no plan.json" in _one_line_error(capsys, ["replan", str(tmp_path), "--without", "east"])
    other = tmp_path / "other.toml"
    other.write_text(SPEC.read_text().replace('cluster = "clusters/', f'cluster = "{SPEC.parent}/clusters/')
                     .replace('model = "tiny"', 'model = "small"'))
    assert "not the run's" in _one_line_error(capsys, ["replan", str(run), "--spec", str(other)])
    nofit = tmp_path / "nofit.toml"
    nofit.write_text(NOFIT)
    small = _run_dir(tmp_path / "n", nofit)
    assert load_plan(small / "plan.json")[0].pp == 2   # the model needs both GPUs' memory
    assert "no plan fits" in _one_line_error(capsys, ["replan", str(small), "--without", "b"])
    assert not (small / "replan.json").exists()
    assert json.loads((small / "plan.json").read_text())["plan"]["dp"] == 1
