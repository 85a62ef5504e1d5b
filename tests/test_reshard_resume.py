"""Resharded resume: a pp=2 x dp=2 checkpoint continues on the layouts left after losing a DC.

Launch 1 (4 ranks: a part of conftest's shared `pipeline_launch`) trains pp=2 x dp=2 (zero3, fp32)
for 10 steps with checkpoints, and that run continued from its checkpoint to step 15 on the same
layout. Launch 2 (2 ranks) resumes the same checkpoint with `resume_from` on pp=2 x dp=1 (a
different layer split, replicated) and on
pp=1 x dp=2 (zero1, whose optimizer partitions regroup by parameter name). Same global batch and
micro-batch, so the same math: steps 11-15 must equal the uninterrupted reference's -- the
single-process loop over the same batches (tests/_reference.py, which the runtime's pp=2 x dp=2
matches: tests/test_runtime_pipeline.py), in-process -- losses, the learning rate (warm-up then
cosine over the job's 30 steps: a function of the step) and the gradient norm; and step 11 must
continue the curve rather than start again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cases import case
from _reference import reference_run
from test_runtime_pipeline import recipe_spec

from geotrain.layout.plan import StagePlan
from geotrain.planner.manual import plan_from_job
from geotrain.runtime.launch import launch
from geotrain.runtime.recipe import lr_at
from geotrain.runtime.train_config import RunCase
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"


def _losses(run: Path) -> dict[int, dict]:
    return {d["step"]: d for d in map(json.loads, (run / "losses.jsonl").read_text().splitlines())}


def _cfg(out: Path, plan, steps: int, **kw) -> RunCase:
    return case(recipe_spec(out.parent), out=str(out), plan=plan, steps=steps, data="synthetic", progress=False,
                trace=False, checkpoint_every=10, **kw)


def _full():
    return plan_from_job(load_spec(SPEC)).with_(precision="fp32", sharding="zero3")


def reshard_cases(tmp: Path) -> list[RunCase]:
    """The 4-rank part, in `tmp` (conftest's `pipeline_launch` runs it): 10 steps of the job's layout, and
    the same layout resumed from them to 15."""
    tmp.mkdir(parents=True, exist_ok=True)
    return [_cfg(tmp / "first", _full(), 10), _cfg(tmp / "same", _full(), 15, resume_from=str(tmp / "first"))]


@pytest.mark.slow
def test_checkpoint_resumes_on_other_layouts(pipeline_launch: Path, tmp_path: Path) -> None:
    full = _full()
    assert (full.pp, full.dp, full.micro_batch, full.num_microbatches) == (2, 2, 2, 4)
    units = full.stages[-1].chunks[-1][1]
    pp2_dp1 = full.with_(dp=1, num_microbatches=8, sharding="replicate", pipeline_offsets=(),
                         stages=(StagePlan("east", ((0, 2),)), StagePlan("west", ((2, units),))))
    pp1_dp2 = full.with_(sharding="zero1", links=(), pipeline_offsets=(),
                         stages=(StagePlan("west", ((0, units),)),))

    tmp = pipeline_launch / "reshard"
    first, same = tmp / "first", tmp / "same"
    assert (first / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    b, c = tmp_path / "pp2_dp1", tmp_path / "pp1_dp2"
    launch([_cfg(b, pp2_dp1, 15, resume_from=str(first)), _cfg(c, pp1_dp2, 15, resume_from=str(first))], 2,
           tmp_path / "l2", timeout_s=180)

    recipe = tmp / "tiny_2dc_recipe.toml"         # _cfg's spec
    losses, norms, _ = reference_run(recipe, full.micro_batch, full.num_microbatches, full.dp, 15)
    job = load_spec(recipe).job
    want = {s: {"loss": losses[s - 1], "grad_norm": norms[s - 1], "lr": lr_at(s, job)} for s in range(1, 16)}
    before = _losses(first)
    for step in range(1, 11):
        assert abs(want[step]["loss"] - before[step]["loss"]) <= 1e-5 * want[step]["loss"]
        assert _losses(same)[step]["loss"] == before[step]["loss"]   # the resumed curve opens with these lines
    for run in (same, b, c):
        got = _losses(run)
        assert sorted(got) == list(range(1, 16)), run
        assert got[11]["resumed_from"] == str(first)
        assert all(got[step] == before[step] for step in range(1, 11))   # carried over, not trained again
        for step in range(11, 16):
            for key in ("loss", "grad_norm"):
                assert abs(got[step][key] - want[step][key]) <= 1e-5 * abs(want[step][key]), \
                    (run.name, step, key, got[step][key], want[step][key])
            assert got[step]["lr"] == want[step]["lr"], (run.name, step)     # the same schedule, continued
    lrs = [want[step]["lr"] for step in range(1, 16)]
    assert lrs[0] < lrs[1] and lrs[10] > lrs[14] > 1e-4     # warmed up, then decaying (cosine to lr/10 at 30)
    # Continues the curve: step 11 is near step 10, far below where training started.
    l1, l10, l11 = want[1]["loss"], want[10]["loss"], want[11]["loss"]
    assert l1 - l10 > 0.1, (l1, l10)
    assert abs(l11 - l10) < 0.5 * (l1 - l10), (l1, l10, l11)


def test_resume_from_a_run_without_checkpoint_is_refused(tmp_path: Path, capsys) -> None:
    from geotrain.cli import main

    (tmp_path / "gone" / "checkpoints").mkdir(parents=True)
    rc = main(["train", str(SPEC), "--out", str(tmp_path / "new"), "--resume-from", str(tmp_path / "gone"),
               "--wan", "off"])
    err = capsys.readouterr().err
    assert rc == 2 and "--resume-from" in err and "no complete checkpoint" in err and len(err.strip().splitlines()) == 1
    rc = main(["train", str(SPEC), "--resume", "--resume-from", str(tmp_path / "gone"), "--wan", "off"])
    assert rc == 2 and "not both" in capsys.readouterr().err
