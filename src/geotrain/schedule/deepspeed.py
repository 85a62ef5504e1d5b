"""DeepSpeed's pipeline schedule (deepspeed.runtime.pipe.schedule.TrainSchedule) as action lists.

Its compute order is 1F1B's (stage s warms up with pp - 1 - s forwards, then alternates), but its
transfers sit elsewhere: the schedule runs in 2 (m + pp - 1) steps, a forward step on the even
stages while the odd ones take a backward step and back; a forward step sends the previous
step's input gradient (SendGrad) and then receives its activation, a backward step receives its
output gradient and then sends the previous step's activation (SendActivation) -- a send waits
for the next step. DeepSpeed's pipe engine sends with blocking NCCL send/recv, so the order is
what keeps neighbours from deadlocking; the simulator runs it as a rendezvous
(`sim.simulate(..., p2p="blocking")`). The DP gradient reduction follows the last step, then the
optimizer (ReduceTiedGrads, ReduceGrads, OptimizerStep).
"""

from __future__ import annotations

from geotrain.schedule.actions import Action, Op, Schedule
from geotrain.schedule.schedule_error import ScheduleError


def _step(step: int, stage: int, stages: int) -> tuple[int, bool]:
    """(micro-batch, is_forward) of `stage`'s step `step` (TrainSchedule._step_to_micro_batch)."""
    even_step, even_stage = step % 2 == 0, stage % 2 == 0
    if even_step == even_stage:   # a forward step
        base = step // 2 if even_step else (step - 1) // 2
        return base - stage // 2, True
    if even_step:                 # odd stage, even step: a backward step
        return step // 2 - stages + (stage + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + stage // 2, False


def deepspeed_1f1b(pp: int, m: int) -> Schedule:
    """The lowered schedule of DeepSpeed's TrainSchedule for `pp` stages and `m` micro-batches."""
    if pp < 1 or m < 1:
        raise ScheduleError("a schedule needs at least one stage and one micro-batch")
    sched = Schedule("1f1b", pp, m)
    for s in range(pp):
        out: list[Action] = []
        prev = -1
        for step in range(2 * (m + pp - 1)):
            mb, forward = _step(step, s, pp)
            valid, prev_valid = 0 <= mb < m, 0 <= prev < m
            if forward:
                if prev_valid and s > 0:
                    out.append(Action(Op.SEND_GRAD, s, prev, s - 1))
                if valid and s > 0:
                    out.append(Action(Op.RECV_ACT, s, mb, s - 1))
            else:
                if valid and s < pp - 1:
                    out.append(Action(Op.RECV_GRAD, s, mb, s + 1))
                if prev_valid and s < pp - 1:
                    out.append(Action(Op.SEND_ACT, s, prev, s + 1))
            if valid:
                out.append(Action(Op.FORWARD if forward else Op.BACKWARD, s, mb))
            prev = mb
        out += [Action(Op.ALLREDUCE, s), Action(Op.OPTIMIZER, s)]
        sched.actions.append(out)
    return sched
