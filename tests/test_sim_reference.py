"""The engine against a naive reference on random plans where links never contend.

The reference is the obvious, slow algorithm written independently of the engine: GPUs take
turns, each runs its action list while the inputs are there (a receive needs its matching send
to have happened, an all-reduce needs every replica to have reached it); a transfer arrives
latency + bytes / rate after it was sent, and its sender holds the ACK one latency later (an
optimizer step waits for the ACKs of the GPU's WAN sends, as the runtime does). With links wide
enough that transfers never compete, the engine (run-ahead units, slots, event heap, processor
sharing) must give the same start time for every compute action.
"""

from __future__ import annotations

import pytest
from _toy import random_case

from geotrain.schedule.actions import Op
from geotrain.sim import simulate_costs

COMPUTE = {Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.OPTIMIZER}


def reference(plan, cluster, sched, costs, allreduce, optimizer, iterations):
    pp, dp = plan.pp, plan.dp
    offsets = list(plan.pipeline_offsets) + [0.0] * dp

    def hop(src: int, dst: int, nbytes: int) -> tuple[float, float]:
        """(arrival after the send, ACK back at the sender after the send)."""
        a, b = plan.stages[src].dc, plan.stages[dst].dc
        if a == b:
            dc = cluster.dc(a)
            return (dc.intra_dc_latency_us * 1e-6 + nbytes / (dc.intra_dc_gbps * 1e9 / 8),) * 2
        wl = cluster.link(a, b)
        lp = plan.link_between(a, b)
        arrive = wl.latency_ms * 1e-3 + nbytes / (wl.rate_gbps(lp.connections) * 1e9 / 8)
        return arrive, arrive + wl.latency_ms * 1e-3

    todo = {(s, d): [(it, a) for it in range(iterations) for a in sched.actions[s]]
            for s in range(pp) for d in range(dp)}
    pos = dict.fromkeys(todo, 0)
    clock = {(s, d): offsets[d] for s, d in todo}
    acked = dict.fromkeys(todo, 0.0)
    arrived: dict[tuple, float] = {}
    reached: dict[tuple, dict[int, float]] = {}
    starts: dict[tuple, float] = {}
    moved = True
    while moved:
        moved = False
        for (s, d), acts in todo.items():
            while pos[(s, d)] < len(acts):
                it, a = acts[pos[(s, d)]]
                t = clock[(s, d)]
                if a.op == Op.OPTIMIZER:
                    t = max(t, acked[(s, d)])
                if a.op in COMPUTE:
                    starts[(s, d, a.op.value, a.stage, a.mb, it)] = t
                    dur = optimizer[s] if a.op == Op.OPTIMIZER else getattr(costs[a.stage], a.op.value)
                    clock[(s, d)] = t + dur
                elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    nbytes = costs[a.stage if a.op == Op.SEND_ACT else a.peer].send_bytes
                    key = (d, a.op == Op.SEND_ACT, a.stage, a.peer, a.mb, it)
                    arrive, ack = hop(s, a.peer % pp, nbytes)
                    arrived[key] = t + arrive
                    acked[(s, d)] = max(acked[(s, d)], t + ack)
                elif a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    key = (d, a.op == Op.RECV_ACT, a.peer, a.stage, a.mb, it)
                    if key not in arrived:
                        break
                    clock[(s, d)] = max(t, arrived[key])
                elif a.op == Op.ALLREDUCE:
                    got = reached.setdefault((s, it), {})
                    got.setdefault(d, t)
                    if len(got) < dp:
                        break
                    clock[(s, d)] = max(got.values()) + allreduce[s]
                else:
                    raise AssertionError(a)
                pos[(s, d)] += 1
                moved = True
    assert all(pos[k] == len(v) for k, v in todo.items()), "reference deadlocked"
    return starts


@pytest.mark.parametrize("seed", range(100, 125))
def test_engine_matches_reference(seed):
    plan, cluster, costs, allreduce, optimizer, iterations = random_case(seed)
    wide = cluster.model_copy(update={"wan_links": [
        w.model_copy(update={"capacity_gbps": 1e6, "per_connection_gbps": 1e4}) for w in cluster.wan_links]})
    plan = plan.with_(links=tuple(lp.__class__(**{**lp.__dict__, "sharing": "fair"}) for lp in plan.links))
    res = simulate_costs(plan, wide, costs, allreduce, optimizer, tokens_per_iteration=1, iterations=iterations)
    ref = reference(plan, wide, res.schedule, costs, allreduce, optimizer, iterations)
    got = {}
    for e in res.trace.events:
        if e.kind in ("forward", "backward", "backward_input", "backward_weight", "optimizer"):
            s, d, _ = plan.coords(e.rank)
            got[(s, d, e.kind, e.stage, e.mb, e.iteration)] = e.start
    assert got.keys() == ref.keys()
    bad = [k for k in ref if got[k] != pytest.approx(ref[k], rel=1e-9, abs=1e-12)]
    assert not bad, [(k, got[k], ref[k]) for k in bad[:5]]
