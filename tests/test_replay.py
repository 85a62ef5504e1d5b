"""Trace replay (calibrate.replay): with a trace the simulator itself produced, replaying its measured
compute durations per op and per rank reproduces it exactly -- whatever compute the model predicts."""

from __future__ import annotations

import pytest
from _toy import toy_cluster, toy_plan, uniform_costs

from geotrain.calibrate.case_rows import bubble_per_rank
from geotrain.calibrate.replay import measured_compute, replay_costs
from geotrain.sim import simulate_costs


@pytest.mark.parametrize("pp,dp,m,dcs,sharing", [(2, 2, 4, 2, "fair"), (3, 2, 5, 2, "temporal"), (4, 1, 6, 1, "fair")])
def test_replay_of_a_simulated_trace_is_that_trace(pp, dp, m, dcs, sharing):
    cluster = toy_cluster(dcs, latency_ms=3.0, capacity_gbps=0.05, per_connection_gbps=0.03, intra_gbps=0.2)
    plan = toy_plan(pp, dp, m, dcs=dcs, sharing=sharing, order=tuple(range(dp)) if sharing == "temporal" else (),
                    pipeline_offsets=[0.007 * d for d in range(dp)])   # replicas apart: each its own durations
    costs = uniform_costs(pp, 0.010, 0.021, send_bytes=40_000)
    allreduce, optimizer = [0.004] * pp, [0.002] * pp
    # The "measured" run: the simulator with a core pool -- units computing at once share 2 cores, so
    # every op on every rank takes its own time (the durations vary per op and per rank).
    pool = [1.0] + [max(1.0, k / 2) * (1 + 0.03 * k) for k in range(1, pp * dp + 1)]
    run = simulate_costs(plan, cluster, costs, allreduce, optimizer, 1000, iterations=2, core_slowdown=pool)
    compute, iterations = measured_compute(run.trace)
    assert iterations == 2 and len(set(round(v, 9) for v in compute.values())) > 4   # not one duration per kind
    # The replay is told a different compute model (3x) and no pool: the measured durations replace it.
    wrong = uniform_costs(pp, 0.030, 0.063, send_bytes=40_000)
    rep = replay_costs(plan, cluster, wrong, allreduce, optimizer, 1000, compute, iterations)
    assert rep.metrics.iteration_time == pytest.approx(run.metrics.iteration_time, rel=1e-12)
    want, got = bubble_per_rank(run.metrics), bubble_per_rank(rep.metrics)
    assert got.keys() == want.keys() and all(got[r] == pytest.approx(want[r], rel=1e-9, abs=1e-12) for r in want)
    ends = sorted(e.end for e in run.trace.events)
    assert sorted(e.end for e in rep.trace.events) == pytest.approx(ends, rel=1e-12)
    # and the prediction with the wrong compute is far off: the replay is not the prediction
    pred = simulate_costs(plan, cluster, wrong, allreduce, optimizer, 1000, iterations=2)
    assert abs(pred.metrics.iteration_time / run.metrics.iteration_time - 1) > 0.2


def test_a_missing_op_is_named():
    plan, cluster = toy_plan(2, 1, 2), toy_cluster(1)
    run = simulate_costs(plan, cluster, uniform_costs(2, 1.0, 2.0), [0.0, 0.0], [0.0, 0.0], 10)
    compute, n = measured_compute(run.trace)
    del compute[(1, "backward", 1, 1, 0)]
    with pytest.raises(ValueError, match="no backward of stage 1, micro-batch 1, iteration 0 on rank 1"):
        replay_costs(plan, cluster, uniform_costs(2, 1.0, 2.0), [0.0, 0.0], [0.0, 0.0], 10, compute, n)
