"""The simulator's core pool (sim.cores): CPU-emulated ranks that outnumber the host's cores share
them by processor sharing; without a pool nothing changes."""

from __future__ import annotations

import pytest
from _toy import random_case, toy_cluster, toy_plan, uniform_costs

from geotrain.sim import simulate_costs

TWO_CORES = [1.0] + [max(1.0, k / 2) for k in range(1, 9)]   # [unused, k=1..8]: k units on 2 cores


def run(plan, costs, core_slowdown=None):
    return simulate_costs(plan, toy_cluster(1, intra_latency_us=0.0), costs, [0.0] * plan.pp, [0.0] * plan.pp,
                          tokens_per_iteration=1, core_slowdown=core_slowdown)


def test_four_ranks_on_two_cores_by_hand():
    """pp2 x dp2 gpipe, m=2, forward 1 s, backward 2 s, free transfers. Alone: 9 s. On two cores:
    0-1 stage 0's F0 (2 units, full speed); at 1 stage 1 is woken by the activation while stage 0
    runs F1: four units at half speed, both end at 3; 3-4 stage 1's F1, 4-6 its B0 (2 units);
    at 6 stage 0 is woken by the gradient while stage 1 runs B1: four at half speed until 10;
    10-12 stage 0's B1. Iteration 12 s."""
    plan = toy_plan(2, 2, 2, schedule="gpipe")
    costs = uniform_costs(2, 1.0, 2.0)
    assert run(plan, costs).iteration_time == pytest.approx(9.0)
    res = run(plan, costs, TWO_CORES)
    assert res.iteration_time == pytest.approx(12.0)
    assert res.metrics.iteration_time == pytest.approx(12.0)
    ev = {(e.rank, e.kind, e.mb): (e.start, e.end) for e in res.trace.events}
    woken = plan.rank(1, 0)
    assert ev[(woken, "forward", 0)] == pytest.approx((1.0, 3.0))      # starts when woken, runs at half speed
    assert ev[(plan.rank(0, 1), "backward", 0)] == pytest.approx((6.0, 10.0))
    assert ev[(plan.rank(0, 1), "backward", 1)] == pytest.approx((10.0, 12.0))


@pytest.mark.parametrize("seed", [3, 11, 42])
def test_a_pool_that_never_slows_changes_nothing(seed):
    plan, cluster, costs, allreduce, optimizer, iterations = random_case(seed)
    a = simulate_costs(plan, cluster, costs, allreduce, optimizer, tokens_per_iteration=1, iterations=iterations)
    b = simulate_costs(plan, cluster, costs, allreduce, optimizer, tokens_per_iteration=1, iterations=iterations,
                       core_slowdown=[1.0] * (plan.num_ranks + 1))
    assert b.iteration_time == pytest.approx(a.iteration_time, rel=1e-9)
    key = sorted((e.rank, e.kind, e.stage, e.mb, e.iteration, round(e.start, 9), round(e.end, 9))
                 for e in a.trace.events)
    assert key == sorted((e.rank, e.kind, e.stage, e.mb, e.iteration, round(e.start, 9), round(e.end, 9))
                         for e in b.trace.events)
