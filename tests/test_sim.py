"""Simulator closed forms: results that must hold exactly, computed by hand."""

from __future__ import annotations

import pytest
from _toy import toy_cluster, toy_plan, uniform_costs

from geotrain.schedule.actions import Op
from geotrain.sim import simulate_costs

FREE = dict(latency_ms=1e-12, capacity_gbps=1e12, per_connection_gbps=1e12, intra_gbps=1e12, intra_latency_us=0.0)


def run(plan, cluster, costs, allreduce=0.0, optimizer=0.0, iterations=1):
    return simulate_costs(plan, cluster, costs, [allreduce] * plan.pp, [optimizer] * plan.pp,
                          tokens_per_iteration=1000, iterations=iterations)


def compute_starts(res):
    """(rank, kind, stage, mb, iteration) -> start, for every compute event."""
    return {(e.rank, e.kind, e.stage, e.mb, e.iteration): e.start for e in res.trace.events
            if e.kind in ("forward", "backward", "backward_input", "backward_weight", "optimizer")}


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m,dp", [(4, 8, 1), (4, 4, 2), (3, 7, 1), (8, 16, 3), (2, 1, 1)])
def test_no_communication_uniform_stages(kind, pp, m, dp):
    tf, tb = 1.0, 2.0
    plan = toy_plan(pp, dp, m, schedule=kind)
    res = run(plan, toy_cluster(1, intra_latency_us=0.0), uniform_costs(pp, tf, tb, send_bytes=0))
    assert res.metrics.iteration_time == (m + pp - 1) * (tf + tb)
    # A non-binary fraction too: equal up to rounding.
    res = run(plan, toy_cluster(1, intra_latency_us=0.0), uniform_costs(pp, 0.3, 0.7, send_bytes=0))
    assert res.metrics.iteration_time == pytest.approx((m + pp - 1) * 1.0, rel=1e-12)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 5, 32])
def test_one_stage(kind, m):
    res = run(toy_plan(1, 2, m, schedule=kind), toy_cluster(1), uniform_costs(1, 0.25, 0.5))
    assert res.metrics.iteration_time == m * 0.75
    assert not [b for b in res.metrics.bubbles]          # a single stage never idles
    assert all(f == pytest.approx(1.0) for f in res.metrics.busy_fraction.values())


def test_allreduce_and_optimizer_add_at_the_end():
    pp, m = 4, 8
    res = run(toy_plan(pp, 2, m), toy_cluster(1, intra_latency_us=0.0), uniform_costs(pp, 1.0, 2.0),
              allreduce=0.5, optimizer=0.25)
    # Stage 0 finishes its last backward last, then reduces and steps.
    assert res.metrics.iteration_time == (m + pp - 1) * 3.0 + 0.75


def test_iterations_repeat_back_to_back():
    pp, m = 3, 6
    plan = toy_plan(pp, 1, m)
    one = run(plan, toy_cluster(1, intra_latency_us=0.0), uniform_costs(pp, 1.0, 2.0))
    three = run(plan, toy_cluster(1, intra_latency_us=0.0), uniform_costs(pp, 1.0, 2.0), iterations=3)
    assert three.metrics.iterations == 3
    # Iteration i+1 starts on each stage after its optimizer step: the pipeline refills, so each
    # window again lasts (m+p-1)(tf+tb).
    assert three.metrics.iteration_time == pytest.approx(one.metrics.iteration_time)
    opt_ends = sorted(e.end for e in three.trace.events if e.kind == "optimizer" and e.rank == 0)
    assert opt_ends == pytest.approx([one.metrics.iteration_time * (i + 1) for i in range(3)])


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_free_wan_equals_one_dc(kind):
    pp, dp, m = 4, 2, 8
    costs = uniform_costs(pp, 0.01, 0.02, send_bytes=8 << 20)
    two = run(toy_plan(pp, dp, m, dcs=2, schedule=kind), toy_cluster(2, **FREE), costs, allreduce=0.01)
    one = run(toy_plan(pp, dp, m, dcs=1, schedule=kind), toy_cluster(1, **FREE), costs, allreduce=0.01)
    assert two.metrics.wan_bytes > 0 and one.metrics.wan_bytes == 0
    assert two.metrics.iteration_time == pytest.approx(one.metrics.iteration_time, rel=1e-9)
    a, b = compute_starts(two), compute_starts(one)
    assert a.keys() == b.keys()
    assert all(a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12) for k in a)


def test_wan_latency_on_the_critical_path():
    """pp=2 across a WAN, one micro-batch: F0, transfer (latency + bytes/rate), F1, B1,
    gradient back (latency + bytes/rate), B0."""
    lat_ms, gbps, nbytes = 10.0, 8.0, 10**7     # 10 MB at 1 GB/s: 10 ms
    plan = toy_plan(2, 1, 1, dcs=2, connections=1)
    cluster = toy_cluster(2, latency_ms=lat_ms, capacity_gbps=gbps, per_connection_gbps=gbps)
    res = run(plan, cluster, uniform_costs(2, 0.1, 0.2, send_bytes=nbytes))
    hop = lat_ms * 1e-3 + nbytes / (gbps * 1e9 / 8)
    assert res.metrics.iteration_time == pytest.approx(2 * 0.3 + 2 * hop, rel=1e-12)
    xfers = [e for e in res.trace.events if e.kind == "transfer"]
    assert sorted(e.link for e in xfers) == ["dc0->dc1", "dc1->dc0"]
    assert all(e.duration == pytest.approx(hop) for e in xfers)
    assert res.metrics.wan_bytes == 2 * nbytes


def test_connections_raise_the_rate_up_to_capacity():
    nbytes = 10**8
    cluster = toy_cluster(2, latency_ms=1e-12, capacity_gbps=40.0, per_connection_gbps=10.0, max_connections=3)

    def hop(n):
        res = run(toy_plan(2, 1, 1, dcs=2, connections=n), cluster, uniform_costs(2, 0.0, 0.0, send_bytes=nbytes))
        return res.metrics.iteration_time / 2

    assert hop(1) == pytest.approx(nbytes / 10e9 * 8)
    assert hop(2) == pytest.approx(nbytes / 20e9 * 8)
    assert hop(8) == pytest.approx(nbytes / 30e9 * 8)   # capped by max_connections=3 (30 < 40 Gbit/s)


def test_pipeline_offsets_shift_replicas():
    pp, m = 2, 4
    plan = toy_plan(pp, 2, m, pipeline_offsets=(0.0, 5.0))
    res = run(plan, toy_cluster(1, intra_latency_us=0.0), uniform_costs(pp, 1.0, 1.0))
    first = {}
    for e in res.trace.events:
        if e.kind == "forward" and e.stage == 0 and e.mb == 0:
            first[e.rank] = e.start
    assert first == {0: 0.0, 1: 5.0}
    # The all-reduce waits for the late replica: window = offset + (m+p-1)(tf+tb).
    assert res.metrics.iteration_time == 5.0 + (m + pp - 1) * 2.0


def test_tp_ranks_mirror_their_group():
    plan = toy_plan(2, 2, 4).with_(tp=2)
    res = run(plan, toy_cluster(1), uniform_costs(2, 1.0, 2.0, send_bytes=1000))
    by_rank = res.trace.by_rank()
    assert res.trace.num_ranks == 8 and set(by_rank) == set(range(8))
    for group in range(4):
        a = [(e.kind, e.start) for e in by_rank[2 * group] if e.kind != "transfer"]
        b = [(e.kind, e.start) for e in by_rank[2 * group + 1]]
        assert a == b


def test_unknown_schedule_and_bad_costs_are_errors():
    from geotrain.errors import GeotrainError

    plan = toy_plan(2, 1, 2, schedule="nope")
    with pytest.raises(GeotrainError, match="nope"):
        run(plan, toy_cluster(1), uniform_costs(2, 1.0, 1.0))
    with pytest.raises(ValueError, match="virtual stage"):
        run(toy_plan(2, 1, 2), toy_cluster(1), uniform_costs(3, 1.0, 1.0))


def test_deadlocking_schedule_is_reported():
    from geotrain.errors import GeotrainError
    from geotrain.schedule.actions import Action, Schedule

    # Both stages wait for each other's gradient/activation before sending anything.
    sched = Schedule("custom", 2, 1, actions=[
        [Action(Op.RECV_GRAD, 0, 0, 1), Action(Op.FORWARD, 0, 0), Action(Op.SEND_ACT, 0, 0, 1),
         Action(Op.BACKWARD, 0, 0), Action(Op.ALLREDUCE, 0), Action(Op.OPTIMIZER, 0)],
        [Action(Op.RECV_ACT, 1, 0, 0), Action(Op.FORWARD, 1, 0), Action(Op.BACKWARD, 1, 0),
         Action(Op.SEND_GRAD, 1, 0, 0), Action(Op.ALLREDUCE, 1), Action(Op.OPTIMIZER, 1)],
    ])
    plan = toy_plan(2, 1, 1)
    with pytest.raises(GeotrainError, match="deadlock"):
        simulate_costs(plan, toy_cluster(1), uniform_costs(2, 1.0, 1.0), [0.0] * 2, [0.0] * 2,
                       tokens_per_iteration=1, schedule=sched)


def test_interleaved_one_dc_no_communication():
    """Interleaved 1F1B with v chunks of uniform cost t/v: the bubble shrinks by v:
    iteration = m (tf + tb) + (p - 1)(tf + tb) / v."""
    pp, m, v = 4, 8, 2
    tf, tb = 1.0, 2.0
    plan = toy_plan(pp, 1, m, schedule="interleaved", virtual_per_stage=v)
    res = run(plan, toy_cluster(1, intra_latency_us=0.0), uniform_costs(pp * v, tf / v, tb / v))
    assert res.metrics.iteration_time == pytest.approx(m * (tf + tb) + (pp - 1) * (tf + tb) / v)
