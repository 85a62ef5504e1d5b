"""Schedule quality under an idealised clock: closed forms, zero bubble, hiding WAN latency.

A deliberately tiny timed executor (not the simulator): compute takes a fixed time per virtual
stage, a transfer arrives `latency` seconds after its send on the link between two adjacent
physical stages, nothing else costs time. Enough to check each builder's order does what its
name promises; the simulator (geotrain.sim) models the real costs.
"""

from __future__ import annotations

import pytest

from geotrain.schedule import Op, build_schedule, check_schedule, wan_extra_warmup


def makespan(sched, f=1.0, b=2.0, bi=None, bw=None, latency=None):
    """Finish time of the last action; stages run their lists in order, receives wait."""
    bi = b / 2 if bi is None else bi
    bw = b - bi if bw is None else bw
    v = sched.virtual_per_stage
    cost = {Op.FORWARD: f / v, Op.BACKWARD: b / v, Op.BACKWARD_INPUT: bi / v, Op.BACKWARD_WEIGHT: bw / v}
    pp = sched.num_stages
    lat = latency or [0.0] * (pp - 1)

    def link(p, q):
        return lat[min(p, q)] if abs(p - q) == 1 else 0.0

    clock, pc = [0.0] * pp, [0] * pp
    arrived: dict[tuple, float] = {}
    while any(pc[p] < len(sched.actions[p]) for p in range(pp)):
        progress = False
        for p in range(pp):
            while pc[p] < len(sched.actions[p]):
                a = sched.actions[p][pc[p]]
                if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    arrived[(a.op == Op.SEND_ACT, a.stage, a.peer, a.mb)] = clock[p] + link(p, a.peer % pp)
                elif a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    key = (a.op == Op.RECV_ACT, a.peer, a.stage, a.mb)
                    if key not in arrived:
                        break
                    clock[p] = max(clock[p], arrived[key])
                else:
                    clock[p] += cost.get(a.op, 0.0)
                pc[p] += 1
                progress = True
        assert progress, "deadlock"
    return max(clock)


@pytest.mark.parametrize("pp,m", [(1, 5), (2, 4), (4, 4), (4, 8), (6, 13)])
def test_gpipe_and_1f1b_closed_form(pp, m):
    f, b = 1.0, 2.0
    for kind in ("gpipe", "1f1b"):
        assert makespan(build_schedule(kind, pp, m), f, b) == pytest.approx((m + pp - 1) * (f + b))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_interleaved_bubble_shrinks_by_v(pp, m):
    f, b = 1.0, 2.0
    for v in (2, 4):
        t = makespan(build_schedule("interleaved", pp, m, virtual_per_stage=v), f, b)
        assert t == pytest.approx(m * (f + b) + (pp - 1) * (f + b) / v)   # Megatron's bubble (p-1)(f+b)/v


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 24)])
def test_zb_h1_bubble(pp, m):
    f = bi = bw = 1.0
    t_zb = makespan(build_schedule("zb-h1", pp, m), f, bi + bw, bi, bw)
    t_1f1b = makespan(build_schedule("1f1b", pp, m), f, bi + bw)
    assert t_1f1b == pytest.approx(m * 3 + (pp - 1) * 3)
    assert t_zb == pytest.approx(m * 3 + (pp - 1) * (f + bi - bw))  # ZB-H1 bubble: (p-1)(F + B_input - W)


def test_wan_extra_warmup_hides_a_slow_link():
    pp, m, f, b = 4, 32, 1.0, 2.0
    lat = [0.0, 4.0, 0.0]                       # stage 1 -> 2 crosses the WAN, 4 s each way
    base = makespan(build_schedule("1f1b", pp, m), f, b, latency=lat)
    extra = wan_extra_warmup(pp, [f] * pp, [b] * pp, lat, max_inflight=[64] * pp)
    assert extra[:2] == [3, 3] and extra[2:] == [0, 0]   # ceil(2 * 4 / 3)
    wan = build_schedule("wan-1f1b", pp, m, extra_warmup=extra)
    check_schedule(wan)
    t = makespan(wan, f, b, latency=lat)
    ideal = (m + pp - 1) * (f + b)
    assert base > ideal + (m - pp) * 1.0        # plain 1F1B stalls on the round trip in steady state
    assert t <= ideal + 2 * 4.0 + 1e-9          # only the first round trip stays exposed
    assert t < base


def test_wan_memory_cap_limits_the_gain():
    pp, m, f, b = 4, 32, 1.0, 2.0
    lat = [0.0, 4.0, 0.0]
    full = wan_extra_warmup(pp, [f] * pp, [b] * pp, lat, max_inflight=[64] * pp)
    capped = wan_extra_warmup(pp, [f] * pp, [b] * pp, lat, max_inflight=[5, 5, 2, 1])
    assert capped == [1, 2, 0, 0]                # stage 1 may warm up as long as stage 0: 3+1 = 2+2
    t_full = makespan(build_schedule("wan-1f1b", pp, m, extra_warmup=full), f, b, latency=lat)
    t_cap = makespan(build_schedule("wan-1f1b", pp, m, extra_warmup=capped), f, b, latency=lat)
    t_none = makespan(build_schedule("1f1b", pp, m), f, b, latency=lat)
    assert t_full < t_cap < t_none
