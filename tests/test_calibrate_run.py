"""One validation case end to end: a real 2-rank run over the user-space WAN, its simulation with
a measured profile, and the comparison row."""

from __future__ import annotations

import math

import pytest

from geotrain.calibrate.cases import Case, run_case
from geotrain.calibrate.timers import time_unit


@pytest.fixture(scope="module")
def tiny_profile():
    from geotrain.models.presets import PRESETS

    m = PRESETS["tiny"]
    prof = {kind: {"2": list(time_unit(m, index, 2, "bf16", repeats=3))}
            for kind, index in (("embedding", 0), ("block", 1), ("head", m.layers + 1))}
    prof["runtime"] = {"cores": 2, "per_action_s": 2e-5}
    return prof


def test_one_case_runs_simulates_and_compares(tmp_path, tiny_profile):
    latency_ms = 25.0
    case = Case("e2e", num_microbatches=2, latency_ms=latency_ms, per_connection_mbps=100)
    row, details = run_case(case, tiny_profile, tmp_path, steps=3, warmup=1)
    # The real run went through the emulated WAN: every 1F1B iteration of pp=2 crosses it at
    # least twice one after the other (activation out, gradient back).
    assert row.measured_iteration_s > 2 * latency_ms / 1000
    assert row.predicted_iteration_s > 2 * latency_ms / 1000
    assert set(row.measured_busy) == set(row.predicted_busy) == {0, 1}
    assert all(0 < b <= 1 for b in row.measured_busy.values())
    assert math.isfinite(row.iteration_error) and math.isfinite(row.busy_error_pp)
    assert row.iteration_error == pytest.approx(
        (row.predicted_iteration_s - row.measured_iteration_s) / row.measured_iteration_s)
    assert (tmp_path / "run" / "measured_trace.jsonl").exists()
    assert (tmp_path / "predicted_trace.jsonl").exists()
    assert details["background_runnable"] >= 0.0
    # The CPU share each rank got while it trained, from its main thread's run-queue wait.
    assert set(details["rank_slowdown"]) == {0, 1}
    assert all(1.0 <= s < 50 for s in details["rank_slowdown"].values())
    # The headline prediction used nothing the run measured, and was written before the run began;
    # the post-hoc one (with the measured CPU share) is kept beside it.
    assert not details["contention_measured"]
    assert (tmp_path / "predicted_trace.jsonl").stat().st_mtime <= details["predicted_at"]
    assert min(p.stat().st_mtime for p in (tmp_path / "run").iterdir()) >= details["predicted_at"]
    assert row.posthoc_iteration_s is not None and math.isfinite(row.posthoc_error)
    assert set(row.measured_bubble_rank) == {0, 1}
    assert sum(row.measured_bubble_rank.values()) == pytest.approx(row.measured_bubble_s)
