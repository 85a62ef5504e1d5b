"""No step waits for the whole world in bf16/fp32; fp16 runs exactly one world-wide collective per step.

Four ranks (pp=2 x dp=2) run the runtime's own worker with torch.distributed's collectives counted
(`_count_collectives.py`): a case of 1 step and one of 3 must run the same number of world-wide
collectives in bf16 (set-up and end-of-run only), and 2 more in fp16 (the overflow flag).
fp16's skip decision stays global: an inf injected on one rank skips that step on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cases import case

from geotrain.runtime.train_config import RunCase

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"
CASES = [("bf16", 1), ("bf16", 3), ("fp16", 1), ("fp16", 3)]   # fp32 runs the bf16 path (no loss scaling)


def sync_cases(tmp: Path) -> list[RunCase]:
    """1 and 3 steps in bf16 and fp16, an inf injected in fp16's step 2 (conftest's `collective_counts` runs them)."""
    return [case(SPEC, out=str(tmp / f"{p}-{n}"), steps=n, data="synthetic", progress=False,
                      checkpoint_every=0, overrides={"precision": p},
                      inject_inf=[[3, 2]] if (p, n) == ("fp16", 3) else [])
            for p, n in CASES]


@pytest.fixture(scope="module")
def counted(collective_counts):
    tmp, counts = collective_counts
    return tmp, counts["sync"]


@pytest.mark.parametrize("precision,per_step", [("bf16", 0), ("fp16", 1)])
def test_world_collectives_per_step(counted, precision, per_step):
    _, counts = counted
    for r, per_case in enumerate(counts):
        by = {c: x["world"] for c, x in zip(CASES, per_case)}
        assert by[(precision, 3)] - by[(precision, 1)] == 2 * per_step, (r, precision, by)


def test_each_rank_builds_the_schedule_once_and_reads_none_of_its_outputs_back(counted):
    """Start-up work once: the schedule the plan check built is the one the rank runs and the summary
    prices; the trace and loss rows go on in memory (their files are still written: checked below)."""
    _, counts = counted
    for r, per_case in enumerate(counts):
        assert [x["schedules"] for x in per_case] == [1] * len(CASES), r
        assert [x["read_back"] for x in per_case] == [[]] * len(CASES), r


def test_loss_is_logged_by_the_last_stage_in_every_precision(counted):
    tmp, _ = counted
    for p, n in CASES:
        rows = [json.loads(x) for x in (tmp / f"{p}-{n}" / "losses.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows] == list(range(1, n + 1))
        assert all(isinstance(x["loss"], float) and x["loss"] > 0 for x in rows), (p, rows)
        assert json.loads((tmp / f"{p}-{n}" / "summary.json").read_text())["final_loss"] == rows[-1]["loss"]
        assert (tmp / f"{p}-{n}" / "trace" / "rank0.jsonl").stat().st_size > 0


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(counted):
    tmp, _ = counted
    rows = [json.loads(x) for x in (tmp / "fp16-3" / "losses.jsonl").read_text().splitlines()]
    assert [x["skipped"] for x in rows] == [False, True, False]
    assert rows[2]["loss_scale"] == rows[0]["loss_scale"] / 2
    summary = json.loads((tmp / "fp16-3" / "summary.json").read_text())
    assert summary["optimizer_steps_per_rank"] == [2, 2, 2, 2]
