"""Every builder yields runnable schedules; the validator catches each kind of broken one."""

from __future__ import annotations

import itertools
import math

import pytest

from geotrain.schedule import Action, Op, build_schedule, check_schedule, lower, peak_inflight, wan_extra_warmup
from geotrain.schedule.builders import one_f_one_b_order, zb_h1_order

PP_M = list(itertools.product(range(1, 7), range(1, 11)))


def _valid_interleaved(pp: int, m: int) -> bool:
    return m % max(1, m // pp) == 0


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1", "wan-1f1b"])
def test_builders_are_valid(kind):
    for pp, m in PP_M:
        sched = build_schedule(kind, pp, m)
        assert (sched.num_stages, sched.num_microbatches, sched.kind) == (pp, m, kind)
        check_schedule(sched)
        check_schedule(sched, fifo="physical")


def test_interleaved_is_valid():
    for (pp, m), v in itertools.product(PP_M, (2, 3, 4)):
        if not _valid_interleaved(pp, m):
            continue
        sched = build_schedule("interleaved", pp, m, virtual_per_stage=v)
        assert sched.virtual_per_stage == v and sched.num_virtual == pp * v
        check_schedule(sched)
        check_schedule(sched, fifo="physical")


def test_wan_1f1b_with_extra_warmup_is_valid():
    for pp, m in PP_M:
        for extra in itertools.product(range(3), repeat=pp) if pp <= 4 else [(2,) * pp]:
            if any(extra[s] < extra[s + 1] - 1 for s in range(pp - 1)):
                with pytest.raises(ValueError, match="deadlock"):
                    build_schedule("wan-1f1b", pp, m, extra_warmup=list(extra))
                continue
            check_schedule(build_schedule("wan-1f1b", pp, m, extra_warmup=list(extra)))


# ---- peak in-flight micro-batches -------------------------------------------------------

def test_peak_inflight_closed_forms():
    for pp, m in PP_M:
        assert peak_inflight(build_schedule("1f1b", pp, m)) == [min(m, pp - s) for s in range(pp)]
        assert peak_inflight(build_schedule("gpipe", pp, m)) == [m] * pp
        # ZB-H1 holds inputs until the deferred weight gradient: every stage at 1F1B's worst, no more
        assert peak_inflight(build_schedule("zb-h1", pp, m)) == [min(m, pp)] * pp


def test_peak_inflight_interleaved_is_warmup_plus_one():
    for (pp, m), v in itertools.product(PP_M, (2, 3)):
        if not _valid_interleaved(pp, m):
            continue
        per_round = m // max(1, m // pp)
        want = [min((v - 1) * per_round + 2 * (pp - 1 - r) + 1, m * v) for r in range(pp)]
        assert peak_inflight(build_schedule("interleaved", pp, m, virtual_per_stage=v)) == want


def test_wan_peak_is_default_plus_extra():
    for pp, m in PP_M:
        for k in range(4):
            extra = [k] * pp
            want = [min(m, pp - s + k) for s in range(pp)]
            assert peak_inflight(build_schedule("wan-1f1b", pp, m, extra_warmup=extra)) == want
    assert peak_inflight(build_schedule("wan-1f1b", 4, 16, extra_warmup=[3, 2, 0, 0])) == [7, 5, 2, 1]


def test_wan_without_extra_is_1f1b():
    for pp, m in PP_M:
        assert build_schedule("wan-1f1b", pp, m).actions == build_schedule("1f1b", pp, m).actions


# ---- lowering ----------------------------------------------------------------------------

def test_zb_h1_input_gradient_sends_weight_gradient_does_not():
    sched = build_schedule("zb-h1", 4, 8)
    for r, acts in enumerate(sched.actions):
        for prev, a in zip(acts, acts[1:]):
            if a.op == Op.SEND_GRAD:
                assert prev.op == Op.BACKWARD_INPUT and (prev.stage, prev.mb) == (a.stage, a.mb)
            if prev.op == Op.BACKWARD_WEIGHT:
                assert a.op not in (Op.SEND_GRAD, Op.SEND_ACT)
        n_sends = sum(a.op == Op.SEND_GRAD for a in acts)
        assert n_sends == (8 if r > 0 else 0)


def test_interleaved_transfers_cross_physical_stages_only():
    sched = build_schedule("interleaved", 2, 4, virtual_per_stage=2)
    sends = {(a.stage, a.peer) for acts in sched.actions for a in acts if a.op == Op.SEND_ACT}
    assert sends == {(0, 1), (1, 2), (2, 3)}          # 1 -> 2 wraps from physical 1 back to 0
    one = build_schedule("interleaved", 1, 4, virtual_per_stage=3)
    assert not any(a.op.is_comm for a in one.actions[0])  # all chunks on one stage: handed over in memory
    check_schedule(one)


def test_allreduce_position():
    pp, m = 3, 4
    compute = one_f_one_b_order(pp, m)
    compute[0] = compute[0] + [Action(Op.PREFILL, 0)]
    sched = lower("1f1b", pp, m, compute, allreduce_at=[len(compute[0]) - 1, None, None])
    ops = [a.op for a in sched.actions[0][-3:]]
    assert ops == [Op.ALLREDUCE, Op.PREFILL, Op.OPTIMIZER]
    check_schedule(sched)
    early = lower("1f1b", pp, m, one_f_one_b_order(pp, m), allreduce_at=[3, None, None])
    with pytest.raises(ValueError, match="gradient reduction before the weight gradient"):
        check_schedule(early)


# ---- the validator rejects broken schedules ---------------------------------------------

def _replace(sched, stage, fn):
    sched.actions[stage] = fn(list(sched.actions[stage]))
    return sched


def test_rejects_missing_backward():
    compute = one_f_one_b_order(1, 4)
    compute[0].remove(Action(Op.BACKWARD, 0, 2))
    with pytest.raises(ValueError, match="before the weight gradient of virtual stage 0 micro-batch 2"):
        check_schedule(lower("1f1b", 1, 4, compute))
    compute[0].append(Action(Op.BACKWARD, 0, 2))   # present, but after the reduction
    with pytest.raises(ValueError, match="before the weight gradient"):
        check_schedule(lower("1f1b", 1, 4, compute, allreduce_at=[len(compute[0]) - 1]))


def test_rejects_backward_before_forward():
    compute = [[Action(Op.BACKWARD, 0, 0), Action(Op.FORWARD, 0, 0)]]
    with pytest.raises(ValueError, match="backward before the forward"):
        check_schedule(lower("x", 1, 1, compute))


def test_rejects_duplicate_forward():
    compute = [[Action(Op.FORWARD, 0, 0), Action(Op.FORWARD, 0, 0), Action(Op.BACKWARD, 0, 0)]]
    with pytest.raises(ValueError, match="second forward"):
        check_schedule(lower("x", 1, 1, compute))


def test_rejects_deadlock():
    with pytest.raises(ValueError, match="deadlocks"):
        check_schedule(lower("x", 4, 8, one_f_one_b_order(4, 8, [1, 2, 1, 0])))


def test_rejects_out_of_order_receive():
    def swap_first_two_forwards(acts):
        i = acts.index(Action(Op.RECV_ACT, 1, 0, 0))
        j = acts.index(Action(Op.RECV_ACT, 1, 1, 0))
        acts[i], acts[j] = acts[j], acts[i]
        return acts
    with pytest.raises(ValueError, match="out of order"):
        check_schedule(_replace(build_schedule("gpipe", 2, 3), 1, swap_first_two_forwards))


def test_rejects_compute_without_receive():
    recv = Action(Op.RECV_ACT, 1, 1, 0)
    sched = _replace(build_schedule("1f1b", 2, 2), 1, lambda acts: [a for a in acts if a != recv])
    with pytest.raises(ValueError, match="no earlier receive"):
        check_schedule(sched)


def test_rejects_unreceived_send():
    sched = _replace(build_schedule("1f1b", 2, 2), 1, lambda acts: [a for a in acts if a.op != Op.SEND_GRAD or a.mb])
    with pytest.raises(ValueError):
        check_schedule(sched)


def test_rejects_weight_gradient_without_input_gradient():
    compute = zb_h1_order(2, 2)
    compute[0] = [a for a in compute[0] if a.op != Op.BACKWARD_INPUT or a.mb != 1]
    compute[0].insert(compute[0].index(Action(Op.BACKWARD_WEIGHT, 0, 1)) + 1, Action(Op.BACKWARD_INPUT, 0, 1))
    with pytest.raises(ValueError, match="without an earlier BACKWARD_INPUT"):
        check_schedule(lower("zb-h1", 2, 2, compute))


def test_rejects_action_on_wrong_physical_stage():
    compute = one_f_one_b_order(2, 2)
    compute[0], compute[1] = compute[1], compute[0]
    with pytest.raises(ValueError, match="lives on physical stage"):
        check_schedule(lower("1f1b", 2, 2, compute))


# ---- wan_extra_warmup ----------------------------------------------------------------------

def test_wan_extra_warmup_covers_round_trip():
    f, b = [1.0] * 4, [2.0] * 4
    lat = [0.0, 7.5, 0.0]                      # one slow link between stages 1 and 2
    extra = wan_extra_warmup(4, f, b, lat, max_inflight=[100] * 4)
    want = math.ceil(2 * 7.5 / 3.0)            # round trip over the period (slowest f + b)
    assert extra == [want, want, 0, 0]
    check_schedule(build_schedule("wan-1f1b", 4, 16, extra_warmup=extra))


def test_wan_extra_warmup_zero_latency_and_memory_cap():
    assert wan_extra_warmup(3, [1, 1, 1], [2, 2, 2], [0, 0], [10, 10, 10]) == [0, 0, 0]
    # stage 0 fits only one more micro-batch than 1F1B's pp - 0 = 3
    extra = wan_extra_warmup(3, [1, 1, 1], [2, 2, 2], [1.0, 5.0], [4, 100, 100])
    assert extra[0] == 1
    assert extra[1] == 2                      # wants ceil(10/3) = 4, lowered to keep warm-up monotone
    assert extra[2] == 0
    assert peak_inflight(build_schedule("wan-1f1b", 3, 20, extra_warmup=extra))[0] <= 4
    check_schedule(build_schedule("wan-1f1b", 3, 20, extra_warmup=extra))


def test_wan_extra_warmup_period_is_slowest_stage():
    # the slowest stage (f + b = 10 s) sets the period: 2 * 6 s / 10 s -> 2 extra
    assert wan_extra_warmup(2, [1.0, 4.0], [2.0, 6.0], [6.0], [10, 10]) == [2, 0]


def test_wan_extra_warmup_rejects_bad_lengths():
    with pytest.raises(ValueError, match="link_latency"):
        wan_extra_warmup(3, [1] * 3, [1] * 3, [0.1], [5] * 3)
    with pytest.raises(ValueError, match="max_inflight"):
        wan_extra_warmup(3, [1] * 3, [1] * 3, [0.1, 0.1], [5] * 2)


def test_unknown_kind_and_bad_sizes():
    with pytest.raises(ValueError, match="unknown schedule kind"):
        build_schedule("nope", 2, 2)
    with pytest.raises(ValueError):
        build_schedule("1f1b", 0, 2)
    with pytest.raises(ValueError, match="virtual_per_stage"):
        build_schedule("interleaved", 2, 2, virtual_per_stage=1)


def test_errors_reach_the_cli_as_one_line():
    from geotrain.errors import GeotrainError
    with pytest.raises(GeotrainError):
        build_schedule("interleaved", 4, 9, virtual_per_stage=2)
    with pytest.raises(GeotrainError):
        check_schedule(lower("x", 4, 8, one_f_one_b_order(4, 8, [1, 2, 1, 0])))
