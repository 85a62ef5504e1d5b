"""Checkpoint/resume: a run killed mid-training and resumed reproduces an uninterrupted run.

Launch 1 fails on purpose (rank 1 raises at step 5, after the step-4 checkpoint): the launcher
must name that rank in a one-line error and leave no process behind. We then plant a half-written
save (a .tmp directory, as a kill during a save leaves) and launch 2 resumes the run; its steps 5-6
must equal the uninterrupted run's: the single-process loop over the same batches (tests/_reference.py,
which this layout matches at 1e-5: tests/test_runtime_pipeline.py), in-process, not a launch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cases import case
from _reference import reference_run

from geotrain.errors import GeotrainError
from geotrain.planner.manual import plan_from_job
from geotrain.runtime.launch import launch
from geotrain.runtime.train_config import RunCase
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"


def _cfg(out: Path, **kw) -> RunCase:
    return case(SPEC, out=str(out), steps=6, data="synthetic", progress=False,
                     checkpoint_every=2, overrides={"precision": "fp32", "sharding": "zero3"}, **kw)


def _losses(run: Path) -> dict[int, float]:
    return {d["step"]: d["loss"] for d in map(json.loads, (run / "losses.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_killed_run_resumes_on_the_same_loss_curve(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    with pytest.raises(GeotrainError) as err:
        launch([_cfg(broken, fail_at=[[1, 5]])], 4, broken, timeout_s=120)
    msg = str(err.value)
    assert "rank 1" in msg and "injected failure at step 5" in msg and "\n" not in msg
    # No rank outlived the launcher's clean-up (ranks carry the run's error directory in their env).
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                environ = (proc / "environ").read_bytes()
            except OSError:
                continue
            assert str(broken / "logs" / "errors").encode() not in environ, f"orphan rank process {proc.name}"
    ckpts = broken / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
    assert set(_losses(broken)) == {1, 2, 3, 4}
    # A save killed half-way leaves a .tmp directory: it must be ignored.
    partial = ckpts / "step_00000006.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"truncated")

    launch([_cfg(broken, resume=True)], 4, tmp_path / "launch2", timeout_s=120)
    plan = plan_from_job(load_spec(SPEC))
    want = dict(enumerate(reference_run(SPEC, plan.micro_batch, plan.num_microbatches, plan.dp, 6)[0], 1))
    got = _losses(broken)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
    assert not partial.exists()
