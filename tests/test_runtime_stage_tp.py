"""Stages of different tensor-parallel degree train exactly like one process training the whole
model: one launch of 3 local ranks (CPU, gloo, the built-in launcher) runs the tiny model as
pp=2 x dp=1 at tp 2/1 and at tp 1/2 back to back -- each stage its own (dp, tp) mesh, boundary
tensors from TP index t' mod the sender's tp -- and each case's per-step losses must match a
single-process reference on the same batches (relative 1e-5), as tp 1/1 does. The tp 2/1 run is
then resumed from its checkpoint at tp 1/2 (DCP reshards the TP-split weights) and both are exported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _cases import case
from _reference import single_process_losses

from geotrain.layout.plan import Plan, StagePlan
from geotrain.planner.manual import split_even
from geotrain.runtime.launch import launch
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"
STEPS, MICRO_BATCH, M = 2, 2, 2


def _plan(tps: tuple[int, int]) -> Plan:
    spec = load_spec(SPEC)
    ranges = split_even(spec.model.num_units, 2)
    stages = tuple(StagePlan(dc=dc, chunks=(r,), tp=t if t != tps[0] else None)
                   for dc, r, t in zip(("east", "west"), ranges, tps, strict=True))
    return Plan(stages=stages, dp=1, tp=tps[0], micro_batch=MICRO_BATCH, num_microbatches=M, precision="fp32",
                schedule="1f1b", sharding="replicate", name=f"tp{tps[0]}-{tps[1]}")


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "losses.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("runtime_stage_tp")
    cases = [case(SPEC, out=str(tmp / name), plan=_plan(tps), steps=STEPS,
                       data="synthetic", progress=False, trace=False, checkpoint_every=STEPS)
             for name, tps in (("tp2-1", (2, 1)), ("tp1-2", (1, 2)))]
    # ... and one more step at tp 1/2 from the tp 2/1 run's checkpoint (both stages' TP-split weights
    # resharded), in the same launch: the cases run back to back
    cases.append(case(SPEC, out=str(tmp / "resumed"), plan=_plan((1, 2)), steps=STEPS + 1,
                           data="synthetic", progress=False, trace=False, checkpoint_every=0,
                           resume_from=str(tmp / "tp2-1")))
    launch(cases, 3, tmp / "launch", timeout_s=120)
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2-1", "tp1-2"])
def test_mixed_tp_matches_single_process(launched: Path, name: str) -> None:
    got = _losses(launched / name)
    want = single_process_losses(SPEC, MICRO_BATCH, M, 1, STEPS)
    assert len(got) == STEPS
    assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0), (name, got, want)
    assert got[-1] < got[0]
    summary = json.loads((launched / name / "summary.json").read_text())
    assert len(summary["memory_per_rank"]) == 3


@pytest.mark.slow
def test_mixed_tp_checkpoint_resumes_at_another_tp_and_exports_whole(launched: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from geotrain.runtime.hf_export import export_run

    got = _losses(launched / "resumed")
    want = single_process_losses(SPEC, MICRO_BATCH, M, 1, STEPS + 1)
    assert len(got) == STEPS + 1 and abs(got[-1] - want[-1]) <= 1e-5 * abs(want[-1]), (got, want)
    a = load_file(export_run(launched / "tp2-1", tmp_path / "a")[0] / "model.safetensors")
    b = load_file(export_run(launched / "tp1-2", tmp_path / "b")[0] / "model.safetensors")
    assert a.keys() == b.keys() and any("q_proj" in k for k in a)
    for k in a:   # whole tensors, the same training whichever stage was TP-split
        # (float noise through Adam: at most 8e-6 here; a misplaced TP shard would be ~1e-2 off)
        assert a[k].shape == b[k].shape and torch.allclose(a[k], b[k], rtol=0, atol=3e-5), k
