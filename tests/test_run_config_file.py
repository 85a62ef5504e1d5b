"""The run file the launcher hands every rank: typed, versioned, one-line errors; the ranks read
Spec and Plan objects from it, never a TOML."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _cases import case

from geotrain.errors import GeotrainError
from geotrain.runtime.runfile import read_run_config, write_run_config
from geotrain.runtime.train_config import WanConfig

ROOT = Path(__file__).resolve().parents[1]


def test_round_trip(tmp_path):
    cases = [case(ROOT / "examples" / "tiny_2dc.toml", out=tmp_path / "a", steps=3, fail_at=[(1, 2)],
                  overrides={"sharding": "zero3"}),
             case(ROOT / "examples" / "tiny_2dc.toml", out=tmp_path / "b", wan=WanConfig(mode="shaper", timeout_s=9))]
    write_run_config(tmp_path / "rc.json", cases)
    # The ranks need no TOML: the experiment travels in the file.
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (tmp_path / "rc.json").write_text((tmp_path / "rc.json").read_text().replace(str(ROOT / "examples"),
                                                                                  str(tmp_path / "examples")))
    shutil.rmtree(tmp_path / "examples")
    back = read_run_config(tmp_path / "rc.json")
    def parts(c):
        return c.spec.model, c.spec.cluster, c.spec.job, c.plan, c.config

    assert [parts(c) for c in back] == [parts(c) for c in cases]
    assert back[0].plan.sharding == "zero3" and back[0].config.hooks.fail_at == [(1, 2)]
    assert back[1].config.wan.timeout_s == 9


def test_a_secret_is_never_written(tmp_path):
    from geotrain.runtime.train_config import ServeConfig

    c = case(ROOT / "examples" / "tiny_2dc.toml", out=tmp_path, serve=ServeConfig(token="s3cret"))
    write_run_config(tmp_path / "rc.json", [c])
    assert "s3cret" not in (tmp_path / "rc.json").read_text()


def _case(**config) -> dict:
    return {"config": {"out": "x", **config}, "plan_file": {}}


@pytest.mark.parametrize("doc, reason", [
    ([{"spec": "a.toml"}], "not a geotrain run config"),                      # the version-less list of old
    ({"format": "geotrain-run-config", "version": 9, "cases": []}, "version 9"),
    ({"format": "geotrain-run-config", "version": 1, "cases": [{"spec": "a"}]}, "version 1; this geotrain reads"),
    ({"format": "geotrain-run-config", "version": 2, "cases": [_case(colour=1)]}, "cases.0.config.colour: unknown"),
    ({"format": "geotrain-run-config", "version": 2, "cases": [_case(steps="many")]}, "cases.0.config.steps"),
    ({"format": "geotrain-run-config", "version": 2, "cases": [{"config": {}}]}, "cases.0.plan_file"),
    ({"format": "geotrain-run-config", "version": 2, "cases": [_case()]}, "carries no experiment"),
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
