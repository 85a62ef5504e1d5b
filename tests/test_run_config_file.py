"""The run-config file the launcher hands every rank: typed, versioned, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from geotrain.errors import GeotrainError
from geotrain.runtime.runfile import read_run_config, write_run_config
from geotrain.runtime.train_config import RunConfig


def test_round_trip(tmp_path):
    cases = [RunConfig(spec="a.toml", steps=3, fail_at=[[1, 2]]), RunConfig(spec="b.toml", wan={"mode": "shaper"})]
    write_run_config(tmp_path / "rc.json", cases)
    assert read_run_config(tmp_path / "rc.json") == cases


@pytest.mark.parametrize("doc, reason", [
    ([{"spec": "a.toml"}], "not a geotrain run config"),                      # the version-less list of old
    ({"format": "geotrain-run-config", "version": 9, "cases": []}, "version 9"),
    ({"format": "geotrain-run-config", "version": 1, "cases": [{"spec": "a", "colour": 1}]}, "cases\\[0\\].colour"),
    ({"format": "geotrain-run-config", "version": 1, "cases": [{"spec": "a", "steps": "many"}]}, "cases.0.steps"),
    ({"format": "geotrain-run-config", "version": 1, "cases": [{"out": "x"}]}, "cases.0.spec"),
])
def test_old_foreign_or_malformed_files_are_one_line_errors(tmp_path, doc, reason):
    path = tmp_path / "rc.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(GeotrainError, match=reason) as e:
        read_run_config(path)
    assert "\n" not in str(e.value)


def test_a_rank_given_a_bad_file_exits_2(tmp_path):
    path = tmp_path / "rc.json"
    path.write_text("[]")
    res = subprocess.run([sys.executable, "-m", "geotrain.runtime.worker", str(path)], capture_output=True,
                         text=True, timeout=120, env={"GEOTRAIN_ERROR_DIR": str(tmp_path / "err"), "RANK": "0",
                                                      "PATH": "/usr/bin:/bin", **_pythonpath()})
    assert res.returncode == 2, res.stderr
    err = json.loads((tmp_path / "err" / "rank0.json").read_text())
    assert err["user_error"] and "not a geotrain run config" in err["message"]


def _pythonpath() -> dict[str, str]:
    import os

    return {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
