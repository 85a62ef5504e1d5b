"""One simulated DP replica stands for all when the replicas are alike (geotrain.sim.symmetry):
the reduced run must give every GPU the same timeline the full engine does."""

from __future__ import annotations

import importlib

import pytest
from _toy import random_case, toy_cluster, toy_plan, uniform_costs

from geotrain.sim import simulate_costs

simulate_mod = importlib.import_module("geotrain.sim.simulate")  # the module, not the function sim re-exports


def _run(plan, cluster, costs, allreduce, optimizer, iterations):
    return simulate_costs(plan, cluster, costs, allreduce, optimizer, tokens_per_iteration=1, iterations=iterations)


def _events(res):
    return sorted((e.rank, e.kind, e.stage, e.mb, e.iteration, e.start, e.end, e.link, e.bytes, e.peer)
                  for e in res.trace.events)


def _both(monkeypatch, *case):
    fast = _run(*case)
    with monkeypatch.context() as m:
        m.setattr(simulate_mod, "replicas_alike", lambda *a: False)
        full = _run(*case)
    return fast, full


def test_fair_replicas_on_a_saturated_link_match_the_full_engine(monkeypatch):
    """dp=6 pipelines over one 100 Gbit/s link whose flows reach 40 Gbit/s each: the replicas
    share it (the link, not a flow's connections, is the limit), so a reduced run that forgot
    to divide the capacity would be 2.4x too fast."""
    cluster = toy_cluster(2, capacity_gbps=100.0, per_connection_gbps=10.0)
    plan = toy_plan(4, 6, 6, dcs=2, connections=4, sharing="fair")
    case = (plan, cluster, uniform_costs(4, 0.01, 0.02, send_bytes=50_000_000), [0.005] * 4, [0.002] * 4, 2)
    fast, full = _both(monkeypatch, *case)
    assert fast.trace.meta["engine"]["replicas_simulated"] == 1
    assert full.trace.meta["engine"]["replicas_simulated"] == 6
    assert fast.iteration_time == pytest.approx(full.iteration_time, rel=1e-12)
    assert [e[:5] + tuple(round(x, 12) for x in e[5:7]) + e[7:] for e in _events(fast)] == \
           [e[:5] + tuple(round(x, 12) for x in e[5:7]) + e[7:] for e in _events(full)]


@pytest.mark.parametrize("seed", range(40))
def test_random_cases_match_the_full_engine(monkeypatch, seed):
    """Fuzz over schedules, DCs, sharing and offsets: whichever cases the reduction takes (fair,
    one start), the timelines equal the full engine's; the others run in full anyway."""
    plan, cluster, costs, allreduce, optimizer, iterations = random_case(seed)
    fast, full = _both(monkeypatch, plan, cluster, costs, allreduce, optimizer, iterations)
    assert fast.iteration_time == pytest.approx(full.iteration_time, rel=1e-12)
    got, want = _events(fast), _events(full)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a[:5] == b[:5] and a[7:] == b[7:]
        assert a[5] == pytest.approx(b[5], rel=1e-12, abs=1e-12) and a[6] == pytest.approx(b[6], rel=1e-12, abs=1e-12)


def test_temporal_or_staggered_replicas_are_simulated_in_full():
    cluster = toy_cluster(2)
    costs = uniform_costs(2, 0.01, 0.02, send_bytes=10_000_000)
    for plan in (toy_plan(2, 3, 4, dcs=2, sharing="temporal"),
                 toy_plan(2, 3, 4, dcs=2, sharing="fair", pipeline_offsets=(0.0, 0.001, 0.002))):
        assert _run(plan, cluster, costs, [0.0] * 2, [0.0] * 2, 1).trace.meta["engine"]["replicas_simulated"] == 3
