"""Lowering: add the communication and per-iteration actions to a compute-only order.

Builders decide only the order of forwards and backwards on each stage; this module adds,
uniformly for every schedule kind, a RECV before each compute that needs a tensor from another
physical stage, a SEND after each compute whose output another stage needs, and the DP
gradient reduction and optimizer step at the end of the iteration.
"""

from __future__ import annotations

from geotrain.schedule.actions import Action, Op, Schedule


def lower(kind: str, num_stages: int, num_microbatches: int, compute: list[list[Action]],
          virtual_per_stage: int = 1) -> Schedule:
    sched = Schedule(kind, num_stages, num_microbatches, virtual_per_stage)
    last = num_stages * virtual_per_stage - 1
    for stage_actions in compute:
        out: list[Action] = []
        for a in stage_actions:
            v = a.stage
            if a.op == Op.FORWARD:
                if v > 0:
                    out.append(Action(Op.RECV_ACT, v, a.mb, v - 1))
                out.append(a)
                if v < last:
                    out.append(Action(Op.SEND_ACT, v, a.mb, v + 1))
            elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                if v < last:
                    out.append(Action(Op.RECV_GRAD, v, a.mb, v + 1))
                out.append(a)
                if v > 0:
                    out.append(Action(Op.SEND_GRAD, v, a.mb, v - 1))
            else:
                out.append(a)
        first_v = min((a.stage for a in stage_actions), default=0)
        out.append(Action(Op.ALLREDUCE, first_v))
        out.append(Action(Op.OPTIMIZER, first_v))
        sched.actions.append(out)
    return sched
