"""WAN link sharing: fair (processor sharing between flows) and temporal (one at a time, plan order)."""

from __future__ import annotations

import pytest
from _toy import toy_cluster, toy_plan, uniform_costs

from geotrain.sim import simulate_costs
from geotrain.sim.links import FairLink, TemporalLink
from geotrain.transport.turns import TURN_OVERHEAD_S


def run(plan, cluster, costs, iterations=1):
    return simulate_costs(plan, cluster, costs, [0.0] * plan.pp, [0.0] * plan.pp, tokens_per_iteration=1,
                          iterations=iterations)


def events(res, kind):
    return sorted((e.rank, e.stage, e.mb, e.iteration, e.start, e.end, e.link, e.bytes, e.peer)
                  for e in res.trace.events if e.kind == kind)


# -- the link resources on their own ------------------------------------------------------------

def test_fair_link_processor_sharing_by_hand():
    link = FairLink(capacity=1.0, flow_rate=1.0, latency=0.0)
    assert link.arrive(0.0, 2, 1, 0, 0, flow=10) == pytest.approx(2.0)   # alone: full rate
    # B joins at t=1: A has 1 byte left, both at 0.5 -> A done at 3; B has 1 left, alone -> 4.
    assert link.arrive(1.0, 2, 2, 1, 0, flow=11) == pytest.approx(3.0)
    done, started = link.complete(3.0)
    assert done == [(0, 0)] and started == []
    assert link.next_completion() == pytest.approx(4.0)
    assert link.complete(4.0) == ([(1, 0)], [])


def test_fair_link_caps_each_flow_and_serializes_one_flow():
    link = FairLink(capacity=1.0, flow_rate=0.4, latency=0.0)
    link.arrive(0.0, 4, 1, 0, 0, flow=1)
    assert link.arrive(0.0, 4, 2, 1, 0, flow=2) == pytest.approx(10.0)   # 0.4 each, not 0.5
    # A second transfer of flow 1 waits behind the first (same connections): no new completion.
    assert link.arrive(0.0, 4, 3, 0, 5, flow=1) is None
    done, started = link.complete(10.0)
    assert sorted(done) == [(0, 0), (1, 0)] and started == [(0, 5)]
    assert link.next_completion() == pytest.approx(20.0)


def test_temporal_link_order_and_latency_overlap():
    link = TemporalLink(flow_rate=2.0, latency=5.0, priority=(1, 0))
    assert link.arrive(0.0, 4, 1, 10, 0, replica=0, flow=0) == 0.0     # an admission is scheduled now
    assert link.arrive(0.0, 4, 2, 11, 0, replica=1, flow=1) is None    # ... and covers this one too
    # Replica 1 comes first in the plan order; one slot: the link is busy for bytes / rate = 2 s.
    assert link.admit(0.0) == [(11, 0)]
    assert link.next_completion() == pytest.approx(2.0)
    done, started = link.complete(2.0)
    assert done == [(11, 0)] and started == [(10, 0)]                  # delivered at 2 + 5 = 7
    assert link.next_completion() == pytest.approx(4.0)


def test_temporal_link_is_work_conserving():
    """One transfer's connections fill a quarter of the link: four transfers hold it at once
    (strict turns sent one at a time and left three quarters idle); a flow's transfers still go
    one after the other."""
    link = TemporalLink(flow_rate=2.0, latency=0.0, priority=(0, 1, 2, 3, 4), capacity=8.0, slots=4)
    for r in range(5):
        link.arrive(0.0, 4, r, r, 0, replica=r, flow=r)
    link.arrive(0.0, 4, 9, 0, 1, replica=0, flow=0)                     # behind flow 0's first
    assert sorted(link.admit(0.0)) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert link.next_completion() == pytest.approx(2.0)                  # each at the full flow rate
    done, started = link.complete(2.0)
    assert sorted(done) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert sorted(started) == [(0, 1), (4, 0)]
    assert link.next_completion() == pytest.approx(4.0)


# -- whole simulations ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_fair_equals_temporal_for_one_pipeline(kind):
    """Bandwidth-bound (transfers queue up behind each other), one pipeline per link."""
    cluster = toy_cluster(3, latency_ms=20.0, capacity_gbps=8.0, per_connection_gbps=2.0)
    costs = uniform_costs(6, 0.002, 0.004, send_bytes=5 * 10**6)   # 5 MB: 5-20 ms on the wire
    fair = run(toy_plan(6, 1, 8, dcs=3, schedule=kind, connections=2, sharing="fair"), cluster, costs, 2)
    temporal = run(toy_plan(6, 1, 8, dcs=3, schedule=kind, connections=2, sharing="temporal"), cluster, costs, 2)
    assert fair.metrics.iteration_time == temporal.metrics.iteration_time
    for kind_ in ("transfer", "forward", "backward", "backward_input", "recv_wait"):
        assert events(fair, kind_) == events(temporal, kind_)
    # ... and the link really was the bottleneck: transfers entered the link (start) later than
    # the compute that produced them ended, having queued behind the previous one.
    produced = {(e.rank, e.stage, e.mb, e.iteration, e.kind == "forward"): e.end for e in fair.trace.events
                if e.kind in ("forward", "backward", "backward_input")}
    xfer = [e for e in fair.trace.events if e.kind == "transfer"]
    queued = [e for e in xfer if e.start > produced[(e.rank, e.stage, e.mb, e.iteration, e.peer > e.rank)] + 1e-6]
    assert queued
    assert all(e.duration == pytest.approx(0.020 + 5e6 / 0.5e9) for e in xfer if "->" in e.link)


def two_pipelines_one_microbatch(sharing, order):
    """pp=2 across a WAN, dp=2, one micro-batch each, both ready at the same time. One transfer
    alone takes T = bytes / capacity (enough connections to fill the link)."""
    cluster = toy_cluster(2, latency_ms=10.0, capacity_gbps=8.0, per_connection_gbps=8.0)
    plan = toy_plan(2, 2, 1, dcs=2, connections=1, sharing=sharing, order=order)
    return run(plan, cluster, uniform_costs(2, 0.1, 0.2, send_bytes=10**8))   # T = 0.1 s


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_temporal_beats_fair_by_hand(order):
    tf, tb, T, lat = 0.1, 0.2, 0.1, 0.01
    fair = two_pipelines_one_microbatch("fair", order)
    temporal = two_pipelines_one_microbatch("temporal", order)
    acts = {e.rank: e for e in fair.trace.events if e.kind == "transfer" and e.stage == 0}
    # Fair: both activations share the link, both finish sending at 2T.
    assert [acts[r].end for r in (0, 1)] == pytest.approx([tf + 2 * T + lat] * 2)
    assert fair.metrics.iteration_time == pytest.approx(2 * tf + 2 * tb + 4 * T + 2 * lat)
    # Temporal: the first in plan order at T, the second at 2T; gradients likewise, staggered
    # by T, so they never compete: the last backward ends T earlier than under fair sharing.
    # Each transfer arrives h later (its turn's grant), the link losing nothing to it.
    h = TURN_OVERHEAD_S
    acts = {e.rank: e for e in temporal.trace.events if e.kind == "transfer" and e.stage == 0}
    first, second = order
    assert acts[first].end == pytest.approx(tf + T + lat + h)
    assert acts[second].start == pytest.approx(tf + T) and acts[second].end == pytest.approx(tf + 2 * T + lat + h)
    assert temporal.metrics.iteration_time == pytest.approx(2 * tf + 2 * tb + 3 * T + 2 * (lat + h))
    assert temporal.metrics.iteration_time < fair.metrics.iteration_time


def test_temporal_never_slower_when_bandwidth_bound():
    """A larger bandwidth-bound case with staggered pipelines: temporal <= fair."""
    cluster = toy_cluster(2, latency_ms=30.0, capacity_gbps=10.0, per_connection_gbps=10.0)
    costs = uniform_costs(4, 0.01, 0.02, send_bytes=20 * 10**6)
    kw = dict(dcs=2, connections=1, order=(0, 1, 2, 3))
    fair = run(toy_plan(4, 4, 8, sharing="fair", **kw), cluster, costs)
    temporal = run(toy_plan(4, 4, 8, sharing="temporal", **kw), cluster, costs)
    assert temporal.metrics.iteration_time <= fair.metrics.iteration_time * (1 + 1e-12)
    # Temporal keeps one transfer at a time on each direction: serialization intervals never overlap.
    rate = 10e9 / 8
    for link in ("dc0->dc1", "dc1->dc0"):
        spans = sorted((e.start, e.start + e.bytes / rate) for e in temporal.trace.events
                       if e.kind == "transfer" and e.link == link)
        assert all(b[0] >= a[1] - 1e-12 for a, b in zip(spans, spans[1:]))
    # Both carry the same bytes; utilization = bytes / (capacity x span) <= 1.
    assert fair.metrics.wan_bytes == temporal.metrics.wan_bytes == 2 * 4 * 8 * 20 * 10**6
    for res in (fair, temporal):
        assert all(0 < u <= 1 + 1e-9 for u in res.metrics.link_utilization.values())


def test_fair_sharing_respects_capacity():
    """At every instant the bytes in flight on a direction never exceed what the capacity allows:
    each transfer lasts at least latency + bytes / flow rate, and the bytes sent over any window
    of transfers fit in capacity x elapsed time."""
    cluster = toy_cluster(2, latency_ms=5.0, capacity_gbps=16.0, per_connection_gbps=4.0)
    costs = uniform_costs(2, 0.001, 0.002, send_bytes=10**7)
    res = run(toy_plan(2, 6, 4, dcs=2, connections=2, sharing="fair"), cluster, costs)
    cap, flow = 16e9 / 8, 8e9 / 8
    for link in ("dc0->dc1", "dc1->dc0"):
        xs = sorted((e.start, e.end - 0.005, e.bytes) for e in res.trace.events
                    if e.kind == "transfer" and e.link == link)
        assert all(b - a >= n / flow - 1e-12 for a, b, n in xs)
        first, last = xs[0][0], max(x[1] for x in xs)
        assert sum(n for _, _, n in xs) <= cap * (last - first) * (1 + 1e-9)


@pytest.mark.parametrize("per_connection", [10.0, 2.5])
@pytest.mark.parametrize("d", [2, 4, 8])
def test_temporal_never_slower_than_fair_on_a_saturated_link(d, per_connection):
    """d pipelines, pp=2 across one WAN link that their transfers saturate (one connection fills
    it, or needs four): temporal <= fair, and start offsets never beat lockstep by losing."""
    from geotrain.planner.sharing import pipeline_offsets

    cluster = toy_cluster(2, latency_ms=20.0, capacity_gbps=10.0, per_connection_gbps=per_connection)
    costs = uniform_costs(2, 0.01, 0.02, send_bytes=3 * 10**7)          # 24 ms per transfer at 10 Gbit/s
    kw = dict(dcs=2, connections=1, order=tuple(range(d)))
    fair = run(toy_plan(2, d, 8, sharing="fair", **kw), cluster, costs).metrics.iteration_time
    lockstep = run(toy_plan(2, d, 8, sharing="temporal", **kw), cluster, costs).metrics.iteration_time
    assert lockstep <= fair * (1 + 1e-9)
    if per_connection == 10.0:
        assert lockstep < fair          # full-rate turns: every pipeline but the last gets its data early
    offsets = pipeline_offsets(d, 3 * 10**7 / (min(per_connection, 10.0) * 1.25e8), 0.1)
    staggered = run(toy_plan(2, d, 8, sharing="temporal", pipeline_offsets=offsets, **kw), cluster, costs)
    assert lockstep <= staggered.metrics.iteration_time * (1 + 1e-9)


@pytest.mark.parametrize("d", [2, 4, 8])
def test_planned_offsets_keep_pipelines_with_a_free_slot_in_lockstep(d):
    """Four transfers fill the link at once (2.5 of 10 Gbit/s per connection): the planned start
    offsets delay only pipelines beyond the first four, one turn per group, and are then never
    slower than lockstep over 3 iterations (offset one by one they were up to 3% slower)."""
    from geotrain.planner.sharing import apply_temporal

    cluster = toy_cluster(2, latency_ms=20.0, capacity_gbps=10.0, per_connection_gbps=2.5)
    base = toy_plan(2, d, 4, dcs=2, connections=1)
    planned = apply_temporal(base, cluster, 3 * 10**7, 0.5, offsets=True)
    turn = 3 * 10**7 / 2.5e9 * 8
    assert planned.pipeline_offsets == pytest.approx([(k // 4) * turn for k in range(d)])
    if d <= 4:
        costs = uniform_costs(2, 0.01, 0.02, send_bytes=3 * 10**7)
        lockstep = run(apply_temporal(base, cluster, 3 * 10**7, 0.5), cluster, costs, iterations=3)
        assert run(planned, cluster, costs, iterations=3).metrics.iteration_time <= \
            lockstep.metrics.iteration_time * (1 + 1e-9)
