"""Blocking P2P (`p2p="blocking"`): DeepSpeed's TrainSchedule order and rendezvous sends, by hand."""

from __future__ import annotations

import pytest
from _toy import toy_cluster, toy_plan, uniform_costs

from geotrain.errors import GeotrainError, InfeasibleError
from geotrain.schedule.actions import Op
from geotrain.schedule.builders import build_1f1b
from geotrain.schedule.checks import check_schedule
from geotrain.schedule.deepspeed import deepspeed_1f1b
from geotrain.sim import simulate_costs

COMPUTE = (Op.FORWARD, Op.BACKWARD)


def run(plan, cluster, costs, p2p):
    return simulate_costs(plan, cluster, costs, [0.0] * plan.pp, [0.0] * plan.pp, tokens_per_iteration=1,
                          p2p=p2p)


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 1), (2, 5), (3, 4), (4, 8), (5, 3)])
def test_deepspeed_order_is_1f1b_compute_with_its_sends(pp, m):
    ds, ref = deepspeed_1f1b(pp, m), build_1f1b(pp, m)
    for s in range(pp):
        assert [a for a in ds.actions[s] if a.op in COMPUTE] == [a for a in ref.actions[s] if a.op in COMPUTE]
    check_schedule(ds, streams=None)   # every send received, nothing missing, no deadlock with eager sends


def test_deepspeed_stage_lists_by_hand():
    s0, s1 = deepspeed_1f1b(2, 2).actions
    assert [f"{a.op.value}{a.mb}" for a in s0] == ["forward0", "send_act0", "forward1", "recv_grad0", "send_act1",
                                                   "backward0", "recv_grad1", "backward1", "allreduce-1",
                                                   "optimizer-1"]
    assert [f"{a.op.value}{a.mb}" for a in s1] == ["recv_act0", "forward0", "backward0", "send_grad0", "recv_act1",
                                                   "forward1", "backward1", "send_grad1", "allreduce-1",
                                                   "optimizer-1"]


def test_blocking_sends_meet_their_receives():
    """pp 2, m 2, forward 1 s, backward 2 s, every transfer 0.5 s (worked out in the comments)."""
    cluster = toy_cluster(1, intra_gbps=8.0, intra_latency_us=0.0)           # 1e9 B/s
    costs = uniform_costs(2, 1.0, 2.0, send_bytes=500_000_000)
    plan = toy_plan(2, 1, 2)
    # Blocking, DeepSpeed's order: s0 F0 [0,1], SA0 meets s1's RA0 [1,1.5], F1 [1.5,2.5], waits at RG0;
    # s1 F0 [1.5,2.5], B0 [2.5,4.5], SG0 [4.5,5]; s0 SA1 [5,5.5], B0 [5.5,7.5]; s1 F1 [5.5,6.5],
    # B1 [6.5,8.5], SG1 [8.5,9]; s0 B1 [9,11].
    res = run(plan, cluster, costs, "blocking")
    assert res.iteration_time == pytest.approx(11.0)
    sends = sorted(x for e in res.trace.events if e.kind == "transfer" for x in (e.start, e.end))
    assert sends == pytest.approx([1.0, 1.5, 4.5, 5.0, 5.0, 5.5, 8.5, 9.0])
    # Overlapped (geotrain's runtime): sends do not wait; s0's B1 starts when SG1 lands at 8.0.
    assert run(plan, cluster, costs, "overlapped").iteration_time == pytest.approx(10.0)
    # Replicas alike: dp 2 runs each pipeline's timeline
    assert run(toy_plan(2, 2, 2), cluster, costs, "blocking").iteration_time == pytest.approx(11.0)


def test_no_transfer_cost_is_the_plain_pipeline():
    pp, m = 4, 8
    res = run(toy_plan(pp, 1, m), toy_cluster(1, intra_latency_us=0.0), uniform_costs(pp, 1.0, 2.0), "blocking")
    assert res.iteration_time == pytest.approx((m + pp - 1) * 3.0)


def test_blocking_is_refused_where_it_is_not_modelled():
    costs = uniform_costs(2, 1.0, 2.0, send_bytes=1000)
    with pytest.raises(InfeasibleError, match="WAN"):
        run(toy_plan(2, 1, 2, dcs=2), toy_cluster(2), costs, "blocking")
    with pytest.raises(GeotrainError, match="1F1B"):
        run(toy_plan(2, 1, 2, schedule="gpipe"), toy_cluster(1), costs, "blocking")
    with pytest.raises(ValueError, match="p2p"):
        run(toy_plan(2, 1, 2), toy_cluster(1), costs, "eager")
