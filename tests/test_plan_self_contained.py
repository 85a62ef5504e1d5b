"""A plan file carries its experiment: copied to another directory, with the spec it was made from
gone, it still simulates and trains (the resolved spec is embedded; the path is only a note)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from geotrain.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
def test_a_moved_plan_file_simulates_and_trains(tmp_path, capsys):
    made = tmp_path / "made"
    (made / "clusters").mkdir(parents=True)
    shutil.copy(EXAMPLES / "tiny_2dc.toml", made / "exp.toml")
    shutil.copy(EXAMPLES / "clusters" / "tiny_2dc.toml", made / "clusters" / "tiny_2dc.toml")
    assert main(["plan", str(made / "exp.toml"), "--out", str(made / "plan.json")]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(made / "plan.json", elsewhere / "plan.json")
    shutil.rmtree(made)                       # the spec and its cluster file are gone

    assert main(["simulate", str(elsewhere / "plan.json"), "--out", str(elsewhere / "sim"), "--no-compare",
                 "--no-progress", "--no-timeline"]) == 0
    assert (elsewhere / "sim" / "trace.jsonl").exists()
    capsys.readouterr()
    rc = main(["train", str(elsewhere / "plan.json"), "--steps", "2", "--out", str(elsewhere / "run"),
               "--data", "synthetic", "--wan", "off", "--no-progress", "--checkpoint-every", "0"])
    assert rc == 0, capsys.readouterr().err
    losses = [json.loads(line) for line in (elsewhere / "run" / "losses.jsonl").read_text().splitlines()]
    assert [x["step"] for x in losses] == [1, 2]
    # The run's own plan.json carries the experiment on, for report/replan/export of the run.
    doc = json.loads((elsewhere / "run" / "plan.json").read_text())
    assert doc["resolved_spec"]["name"] == "tiny-2dc" and doc["resolved_spec"]["model"]["name"] == "tiny"
