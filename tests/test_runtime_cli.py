"""`geotrain train` user errors: one line, exit status 2, before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

from geotrain.cli import main

SPEC = Path(__file__).resolve().parents[1] / "examples" / "tiny_2dc.toml"


def test_unknown_schedule_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    assert main(["train", str(SPEC), "--schedule", "nope", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("geotrain train: error:") and "nope" in err and "\n" not in err
    assert not (tmp_path / "r").exists()


def test_plan_file_without_spec_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    from geotrain.planner.manual import plan_from_job
    from geotrain.spec.load import load_spec

    plan = plan_from_job(load_spec(SPEC))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "geotrain-plan", "version": 2, "spec": None, "plan": plan.to_dict()}))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not name the experiment spec" in err and "\n" not in err


def test_tensor_parallel_wider_than_a_node_is_refused_clearly(tmp_path: Path, capsys) -> None:
    from geotrain.layout.plan import save_plan
    from geotrain.planner.manual import plan_from_job
    from geotrain.spec.load import load_spec

    plan = plan_from_job(load_spec(SPEC)).with_(tp=4)   # the tiny cluster's nodes have 2 GPUs
    path = tmp_path / "plan.json"
    save_plan(path, plan, spec_path=str(SPEC))
    assert main(["train", str(path), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "tp=4 is wider than a node" in err and "\n" not in err
    assert not (tmp_path / "r").exists()
