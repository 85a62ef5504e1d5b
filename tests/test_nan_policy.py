"""A NaN loss never passes for a result (issue #30): a model whose weights are all NaN trained to
the end with exit 0 and `losses.jsonl` held bare `NaN`. Now the run stops at the first
non-finite loss with one line (job.nan_policy = "stop", the default), and every JSON file it
wrote parses as strict JSON (no NaN / Infinity constants); "continue" trains on with null losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _cli import geotrain
from safetensors.torch import save_file

from geotrain.models.hf_weights import hf_config, to_hf_state
from geotrain.models.llama import build_units
from geotrain.spec.load import load_model

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "tiny_2dc.toml"


def nan_model(path: Path) -> Path:
    """The tiny preset's shape as an HF directory whose every weight is NaN."""
    spec = load_model("tiny")
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config(spec)))
    units = build_units(spec, 0, spec.num_units)
    nan = [(n, torch.full(p.shape, float("nan"))) for n, p in units.named_parameters()]
    save_file(to_hf_state(nan, spec), str(path / "model.safetensors"))
    return path


def strict(text: str):
    def refuse(constant: str):
        raise ValueError(f"bare {constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _spec(tmp: Path, policy: str | None) -> Path:
    nan_model(tmp / "nan-model")
    extra = f'nan_policy = "{policy}"\n' if policy else ""
    spec = tmp / "exp.toml"
    spec.write_text(f'cluster = "{CLUSTER}"\nmodel = {{ hf = "nan-model" }}\n[job]\nglobal_batch = 4\n'
                    f'micro_batch = 2\npp = 1\ndp = 1\nprecision = "fp32"\nsharding = "replicate"\n{extra}')
    return spec


@pytest.mark.slow
def test_a_nan_loss_stops_the_run_in_one_line_and_every_json_file_is_strict(tmp_path, capfd):
    rc, _, err = geotrain(capfd, "train", _spec(tmp_path, None), "--steps", "3", "--out", tmp_path / "run", "--wan",
                          "off", "--no-progress", "--data", "synthetic")
    err = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1 and "step 1: the training loss is nan" in err[0], err
    rows = [strict(x) for x in (tmp_path / "run" / "losses.jsonl").read_text().splitlines() if x.strip()]
    assert [(r["step"], r["loss"], r["loss_nonfinite"]) for r in rows] == [(1, None, "nan")]
    files = [p for p in (tmp_path / "run").rglob("*.json*") if p.is_file()]
    assert files
    for p in files:
        text = p.read_text()
        for doc in (text.splitlines() if p.suffix == ".jsonl" else [text]):
            if doc.strip():
                strict(doc)


@pytest.mark.slow
def test_nan_policy_continue_trains_on_with_null_losses(tmp_path, capfd):
    rc, _, err = geotrain(capfd, "train", _spec(tmp_path, "continue"), "--steps", "2", "--out", tmp_path / "run",
                          "--wan", "off", "--no-progress", "--data", "synthetic")
    assert rc == 0, err
    rows = [strict(x) for x in (tmp_path / "run" / "losses.jsonl").read_text().splitlines() if x.strip()]
    assert [r["loss"] for r in rows] == [None, None]
    assert strict((tmp_path / "run" / "summary.json").read_text())["final_loss"] is None
