"""The fast engine against the simulator's specification (geotrain.sim.reference) on random plans:
every schedule kind, links that contend (fair and temporal sharing, several slots), pipeline
offsets, replicas alike (one simulated for all), mixed tensor parallelism (scattered boundaries
and copies), core pools and blocking sends. Every compute, all-reduce and transfer must start and
end when the reference says."""

from __future__ import annotations

import random

import pytest
from _toy import random_case, toy_cluster, toy_plan, uniform_costs

from geotrain.layout.plan import StagePlan
from geotrain.layout.stage_costs import StageCosts
from geotrain.sim import simulate_costs
from geotrain.sim.reference import iteration_time, reference_events

KINDS = ("forward", "backward", "backward_input", "backward_weight", "optimizer", "allreduce")


def engine_events(res, plan) -> dict[tuple, tuple[float, float]]:
    out = {}
    for e in res.trace.events:
        s, d, t = plan.coords(e.rank)
        if e.kind in KINDS and t == 0:
            out[(s, d, e.kind, e.stage, e.mb, e.iteration)] = (e.start, e.end)
        elif e.kind == "transfer":
            out[(s, d, "transfer", e.stage, e.mb, e.iteration, plan.coords(e.peer)[0])] = (e.start, e.end)
    return out


def check(plan, cluster, costs, allreduce, optimizer, iterations, core_slowdown=None, p2p="overlapped",
          step_sync=None):
    res = simulate_costs(plan, cluster, costs, allreduce, optimizer, tokens_per_iteration=1, iterations=iterations,
                         core_slowdown=core_slowdown, p2p=p2p, step_sync=step_sync)
    ref = reference_events(plan, StageCosts(None, cluster), res.schedule, costs, allreduce, optimizer, iterations,
                           core_slowdown, blocking=p2p == "blocking", step_sync=step_sync)
    got = engine_events(res, plan)
    assert got.keys() == ref.keys()
    bad = [k for k in ref if got[k] != pytest.approx(ref[k], rel=1e-9, abs=1e-12)]
    assert not bad, [(k, got[k], ref[k]) for k in bad[:5]]
    assert res.iteration_time == pytest.approx(iteration_time(ref, iterations), rel=1e-9)
    return res


@pytest.mark.parametrize("seed", range(100, 160))
def test_engine_matches_the_reference(seed):
    """Random plans as _toy.random_case makes them (both sharings, contending links, offsets); every
    third with a step-wide collective before the optimizer step."""
    case = random_case(seed)
    check(*case, step_sync=[0.004 * (s + 1) for s in range(case[0].pp)] if seed % 3 == 0 else None)


@pytest.mark.parametrize("seed", range(200, 215))
def test_engine_matches_the_reference_with_mixed_tp(seed):
    """Stages of tp 1, 2 and 4: scattered boundaries (the receiver's TP gather) and whole copies."""
    plan, cluster, costs, allreduce, optimizer, iterations = random_case(seed)
    rng = random.Random(seed)
    tps = [rng.choice([1, 2, 2, 4]) for _ in range(plan.pp)]
    plan = plan.with_(stages=tuple(StagePlan(dc=st.dc, chunks=st.chunks, tp=t) for st, t in zip(plan.stages, tps)))
    check(plan, cluster, costs, allreduce, optimizer, iterations)


@pytest.mark.parametrize("seed", range(300, 312))
def test_engine_matches_the_reference_on_a_core_pool(seed):
    """Compute sharing a host's cores (processor sharing on 2 cores, a residual of 1.1)."""
    plan, cluster, costs, allreduce, optimizer, iterations = random_case(seed)
    units = plan.pp * plan.dp
    check(plan, cluster, costs, allreduce, optimizer, iterations,
          core_slowdown=[1.0] + [1.1 * max(1.0, k / 2) for k in range(1, units + 1)])


@pytest.mark.parametrize("dp,sharing", [(4, "fair"), (6, "fair"), (3, "temporal")])
def test_engine_matches_the_reference_with_replicas_on_one_saturated_link(dp, sharing):
    """Fair replicas alike are simulated as one (sim.symmetry); temporal ones take turns."""
    cluster = toy_cluster(2, capacity_gbps=100.0, per_connection_gbps=10.0)
    plan = toy_plan(4, dp, 6, dcs=2, connections=4, sharing=sharing, order=tuple(range(dp)))
    res = check(plan, cluster, uniform_costs(4, 0.01, 0.02, send_bytes=50_000_000), [0.005] * 4, [0.002] * 4, 2)
    assert res.trace.meta["engine"]["replicas_simulated"] == (1 if sharing == "fair" else dp)


@pytest.mark.parametrize("pp,m", [(2, 2), (3, 5), (4, 8)])
def test_engine_matches_the_reference_with_blocking_sends(pp, m):
    cluster = toy_cluster(1)
    plan = toy_plan(pp, 2, m)
    check(plan, cluster, uniform_costs(pp, 0.01, 0.02, send_bytes=4_000_000), [0.003] * pp, [0.001] * pp, 2,
          p2p="blocking")
