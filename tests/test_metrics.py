"""Metrics on hand-made traces (what the runtime records) and agreement with the simulator's columns."""

from __future__ import annotations

import pytest
from _toy import toy_cluster, toy_plan, uniform_costs

from geotrain.sim import simulate_costs
from geotrain.trace.metrics import columns_from_events, compute_metrics
from geotrain.trace.schema import Event, Trace


def ev(rank, kind, start, end, **kw):
    return Event(rank=rank, kind=kind, start=start, end=end, **kw)


def two_rank_trace() -> Trace:
    """Rank 0: F 0-1, F 1-2, B 4-6, B 6-8, opt 8-9. Rank 1: F 2-3, B 3-4 (after waiting 1-2),
    F 4-5, B 5-6, opt 6-7 then idle. Transfers: 3 over a WAN direction, one intra-DC."""
    evs = [
        ev(0, "forward", 0, 1, stage=0, mb=0), ev(0, "forward", 1, 2, stage=0, mb=1),
        ev(0, "backward", 4, 6, stage=0, mb=0), ev(0, "backward", 6, 8, stage=0, mb=1),
        ev(0, "optimizer", 8, 9, stage=0),
        ev(1, "recv_wait", 1, 2, stage=1, mb=0),
        ev(1, "forward", 2, 3, stage=1, mb=0), ev(1, "backward", 3, 4, stage=1, mb=0),
        ev(1, "forward", 4, 5, stage=1, mb=1), ev(1, "backward", 5, 6, stage=1, mb=1),
        ev(1, "optimizer", 6, 7, stage=1),
        ev(0, "transfer", 1, 2, stage=0, mb=0, bytes=100, link="A->B", peer=1),
        ev(0, "transfer", 2, 4, stage=0, mb=1, bytes=100, link="A->B", peer=1),
        ev(1, "transfer", 4, 4.5, stage=1, mb=0, bytes=50, link="B->A", peer=0),
        ev(1, "transfer", 3, 5, stage=1, mb=0, bytes=7, link="B", peer=2),
    ]
    return Trace(events=evs, num_ranks=2, meta={"links": {"A->B": {"capacity_Bps": 50.0}}})


def test_hand_made_trace():
    m = compute_metrics(two_rank_trace(), tokens_per_iteration=900)
    assert m.iteration_time == 9.0 and m.tokens_per_s == 100.0
    assert m.busy_fraction == {0: 7 / 9, 1: 5 / 9}
    assert m.mean_utilization == pytest.approx(6 / 9)
    assert m.bubbles == [(0, 2.0, 4.0), (1, 0.0, 2.0), (1, 7.0, 9.0)]
    assert m.bubble_fraction == pytest.approx(6 / 18)
    # WAN direction with a known capacity: bytes / (capacity x span) = 200 / (50 x 9).
    assert m.link_utilization["A->B"] == pytest.approx(200 / 450)
    # Without a capacity: the fraction of the span with a transfer in flight.
    assert m.link_utilization["B->A"] == pytest.approx(0.5 / 9)
    assert m.link_utilization["B"] == pytest.approx(2 / 9)
    assert m.wan_bytes == 250
    assert m.peak_memory == {}


def test_iterations_average_and_wan_bytes_per_iteration():
    base = two_rank_trace().events
    shifted = [Event(**{**{k: getattr(e, k) for k in e.__slots__}, "start": e.start + 9, "end": e.end + 9,
                        "iteration": 1}) for e in base]
    m = compute_metrics(Trace(events=base + shifted, num_ranks=2), tokens_per_iteration=900,
                        peak_memory={0: 1.0, 1: 2.0})
    assert m.iterations == 2 and m.iteration_time == 9.0
    assert m.busy_fraction == {0: 7 / 9, 1: 5 / 9}
    assert m.wan_bytes == 250
    assert len(m.bubbles) == 6 and (1, 9.0, 11.0) in m.bubbles
    assert m.peak_memory == {0: 1.0, 1: 2.0}


def test_rank_without_compute_is_one_bubble():
    evs = two_rank_trace().events
    m = compute_metrics(Trace(events=evs, num_ranks=3), tokens_per_iteration=1)
    assert m.busy_fraction[2] == 0.0 and (2, 0.0, 9.0) in m.bubbles


def test_sim_columns_match_its_events():
    """The simulator's columns (fast path) and columns rebuilt from its Event objects give the
    same metrics."""
    plan = toy_plan(4, 2, 6, dcs=2, sharing="temporal", order=(1, 0)).with_(tp=2)
    cluster = toy_cluster(2, latency_ms=5.0, capacity_gbps=4.0, per_connection_gbps=4.0)
    res = simulate_costs(plan, cluster, uniform_costs(4, 0.01, 0.02, send_bytes=10**6), [0.003] * 4, [0.001] * 4,
                         tokens_per_iteration=1234, iterations=2)
    fast = res.metrics
    slow = compute_metrics(Trace(events=list(res.trace.events), num_ranks=res.trace.num_ranks, meta=res.trace.meta),
                           tokens_per_iteration=1234)
    assert fast.iteration_time == slow.iteration_time
    assert fast.busy_fraction == slow.busy_fraction
    assert fast.bubbles == slow.bubbles
    assert fast.link_utilization == pytest.approx(slow.link_utilization)
    assert fast.wan_bytes == slow.wan_bytes
    cols = columns_from_events(res.trace.events)
    assert len(cols) == len(res.trace.columns())


def test_sim_trace_events_can_grow():
    """Appending events (e.g. prefill placed in bubbles) is seen by the metrics."""
    res = simulate_costs(toy_plan(2, 1, 2), toy_cluster(1), uniform_costs(2, 1.0, 2.0), [0.0] * 2, [0.0] * 2,
                         tokens_per_iteration=1)
    before = res.metrics
    res.trace.events.append(Event(rank=1, kind="prefill", start=0.0, end=0.5))
    after = compute_metrics(res.trace, tokens_per_iteration=1)
    assert len(res.trace.columns()) == len(res.trace.events)
    assert after.iteration_time == before.iteration_time and after.bubbles == before.bubbles  # prefill is not training


def test_empty_trace_is_an_error():
    with pytest.raises(ValueError):
        compute_metrics(Trace(events=[], num_ranks=1), tokens_per_iteration=1)
