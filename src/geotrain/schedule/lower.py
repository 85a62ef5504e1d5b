"""Lowering: add the communication and per-iteration actions to a compute-only order.

Builders decide only the order of forwards and backwards on each stage; this module adds,
uniformly for every schedule kind, a RECV before each compute that needs a tensor from another
physical stage, a SEND after each compute whose output another stage needs, and the DP
gradient reduction and optimizer step.

What crosses a stage boundary:
- FORWARD of virtual stage v receives v-1's activation and sends its own to v+1;
- BACKWARD and BACKWARD_INPUT of v receive v+1's gradient and send theirs to v-1;
- BACKWARD_WEIGHT only produces dL/dW, which stays on the stage: no transfer.
Neighbouring virtual stages on the same physical stage (interleaving with pp == 1) hand the
tensor over in memory, so no transfer is inserted for them.

Receives are placed right before the compute that needs them and sends right after the
compute that produced the tensor, so a runtime with blocking receives and non-blocking sends
runs the list as written (see `check_schedule`, which executes it symbolically).
"""

from __future__ import annotations

from collections.abc import Sequence

from geotrain.schedule.actions import Action, Op, Schedule
from geotrain.schedule.schedule_error import ScheduleError


def lower(kind: str, num_stages: int, num_microbatches: int, compute: list[list[Action]],
          virtual_per_stage: int = 1, allreduce_at: Sequence[int | None] | None = None) -> Schedule:
    """Turn per-physical-stage compute orders into a full schedule.

    allreduce_at: per physical stage, how many of its compute actions run before the DP
    gradient reduction (None or missing: after all of them, the default). An earlier position
    lets trailing work that produces no weight gradient (e.g. BubbleTea PREFILL placed in the
    cool-down bubble) overlap the reduction; `check_schedule` rejects a position before the
    stage's last weight gradient. The optimizer step always ends the list.
    """
    if len(compute) != num_stages:
        raise ScheduleError(f"compute order has {len(compute)} stage lists, expected {num_stages}")
    if allreduce_at is not None and len(allreduce_at) != num_stages:
        raise ScheduleError(f"allreduce_at has {len(allreduce_at)} entries, expected {num_stages}")
    sched = Schedule(kind, num_stages, num_microbatches, virtual_per_stage)
    last = num_stages * virtual_per_stage - 1

    def phys(v: int) -> int:
        return v % num_stages

    for s, stage_actions in enumerate(compute):
        at = len(stage_actions) if allreduce_at is None or allreduce_at[s] is None else allreduce_at[s]
        if not 0 <= at <= len(stage_actions):
            raise ScheduleError(f"allreduce_at[{s}]={at} is outside 0..{len(stage_actions)}")
        out: list[Action] = []
        for i, a in enumerate(stage_actions):
            if i == at:
                out.append(Action(Op.ALLREDUCE, s))
            v = a.stage
            if a.op == Op.FORWARD:
                if v > 0 and phys(v - 1) != phys(v):
                    out.append(Action(Op.RECV_ACT, v, a.mb, v - 1))
                out.append(a)
                if v < last and phys(v + 1) != phys(v):
                    out.append(Action(Op.SEND_ACT, v, a.mb, v + 1))
            elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                if v < last and phys(v + 1) != phys(v):
                    out.append(Action(Op.RECV_GRAD, v, a.mb, v + 1))
                out.append(a)
                if v > 0 and phys(v - 1) != phys(v):
                    out.append(Action(Op.SEND_GRAD, v, a.mb, v - 1))
            else:
                out.append(a)
        if at == len(stage_actions):
            out.append(Action(Op.ALLREDUCE, s))
        out.append(Action(Op.OPTIMIZER, s))
        sched.actions.append(out)
    return sched
