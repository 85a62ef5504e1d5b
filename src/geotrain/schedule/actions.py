"""The action vocabulary shared by the simulator and the runtime.

A schedule lists, for each physical pipeline stage, the actions its GPUs perform in order.
Every DP replica of a stage runs the same list (replicas differ only in data and, on a shared
WAN link, in when their transfers get the link -- that is the plan's business, not the list's).

Stages in actions are *virtual* stages: with interleaving, physical stage s holds virtual stages
s, s + pp, s + 2 pp, ...; without it virtual and physical stages coincide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Op(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"                # full backward: input and weight gradients
    BACKWARD_INPUT = "backward_input"    # zero-bubble split: dL/dx only
    BACKWARD_WEIGHT = "backward_weight"  # zero-bubble split: dL/dW only
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"
    ALLREDUCE = "allreduce"              # DP gradient reduction inside the DC
    OPTIMIZER = "optimizer"
    PREFILL = "prefill"                  # BubbleTea inference work placed in a bubble

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_OPS

    @property
    def is_comm(self) -> bool:
        return self in (Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD)


COMPUTE_OPS = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.OPTIMIZER, Op.PREFILL})


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a stage's list.

    stage: the virtual stage that computes, sends or receives.
    mb:    micro-batch index, or -1 for per-iteration actions (all-reduce, optimizer).
    peer:  for send/recv, the virtual stage on the other end; else -1.
    """

    op: Op
    stage: int
    mb: int = -1
    peer: int = -1

    def __str__(self) -> str:
        s = f"{self.op.value}(s{self.stage}"
        if self.mb >= 0:
            s += f",mb{self.mb}"
        if self.peer >= 0:
            s += f",peer{self.peer}"
        return s + ")"


@dataclass
class Schedule:
    """Per-physical-stage action lists for one iteration of one pipeline."""

    kind: str
    num_stages: int                      # physical stages (pp)
    num_microbatches: int
    virtual_per_stage: int = 1           # >1 for interleaved schedules
    actions: list[list[Action]] = field(default_factory=list)

    @property
    def num_virtual(self) -> int:
        return self.num_stages * self.virtual_per_stage

    def physical(self, virtual_stage: int) -> int:
        return virtual_stage % self.num_stages

    def compute_order(self, stage: int) -> list[Action]:
        return [a for a in self.actions[stage] if a.op.is_compute]
