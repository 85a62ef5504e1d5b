"""Schedule checks: is a lowered schedule complete, consistent and free of deadlock?

`check_schedule` executes every stage's list symbolically, the way the runtime does: sends
never block, a receive blocks until its peer has sent, and each compute checks that its inputs
are there (received, or computed earlier on the same stage). Stages take turns (round robin);
when a full round makes no progress while some stage is still waiting, the schedule deadlocks.
Transfers travel on FIFO channels, one per (sending virtual stage, receiving virtual stage,
activation|gradient); with fifo="physical" one per (sending physical stage, receiving physical
stage, activation|gradient) -- what a runtime that does not tag messages by virtual stage needs.

Then `inorder.check_in_order` runs the lists once more the way the runtime posts them (receives
`lookahead` actions early) over an in-order, rendezvous transport (NCCL semantics: tags ignored,
one stream per communicator, a send completes only against a running receive), with the runtime's
stream layout -- so a schedule that passes cannot deadlock on NCCL either.
"""

from __future__ import annotations

from collections import defaultdict, deque

from geotrain.schedule.actions import Action, Op, Schedule
from geotrain.schedule.inorder import check_in_order
from geotrain.schedule.posting import RUNTIME_LOOKAHEAD
from geotrain.schedule.schedule_error import ScheduleError

_WEIGHT_GRAD = (Op.BACKWARD, Op.BACKWARD_WEIGHT)


def check_schedule(schedule: Schedule, fifo: str = "virtual", lookahead: int | None = RUNTIME_LOOKAHEAD,
                   streams: str | None = "directed") -> None:
    """Raise ScheduleError, a ValueError (naming stage, position and action) if `schedule` is not runnable.

    Checks: each physical stage lists only its own virtual stages (v % pp); each (virtual stage,
    micro-batch) has exactly one FORWARD and either one BACKWARD or one BACKWARD_INPUT plus one
    BACKWARD_WEIGHT, forward first; a backward runs only after the gradient of the downstream
    stage's backward was received; every send has exactly one matching receive, in the order
    sent per channel; no deadlock; one ALLREDUCE per stage after all its weight gradients and
    one OPTIMIZER after it. Then, unless streams is None, that the runtime's posting (`lookahead`)
    completes over an in-order transport with that stream layout ("directed": the runtime's,
    "shared": one stream per rank).
    """
    if fifo not in ("virtual", "physical"):
        raise ScheduleError(f"fifo must be 'virtual' or 'physical', got {fifo!r}")
    _Executor(schedule, fifo).run()
    if streams is not None:
        check_in_order(schedule, lookahead, streams)


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per physical stage, the most micro-batches whose activations it holds at once.

    A forward of (virtual stage, micro-batch) starts holding activations; they are freed when
    its backward is complete -- after BACKWARD, or after BACKWARD_WEIGHT for split backwards
    (the weight gradient still needs the stage's inputs). With interleaving the count is of
    (virtual stage, micro-batch) pairs, each holding one chunk's activations: divide by
    virtual_per_stage for whole-stage micro-batches when the chunks are equal."""
    peaks = []
    for acts in schedule.actions:
        live = peak = 0
        for a in acts:
            if a.op == Op.FORWARD:
                live += 1
                peak = max(peak, live)
            elif a.op in _WEIGHT_GRAD:
                live -= 1
        peaks.append(peak)
    return peaks


def peak_held(schedule: Schedule, held_weight=None, deferred_weight=None) -> list[tuple[float, float]]:
    """Per physical stage, at the moment its activation bytes peak: (the sum of `held_weight(v)`
    over the (virtual stage, micro-batch) pairs whose activations it holds, the sum of
    `deferred_weight(v)` over those a split backward ran BACKWARD_INPUT for and not yet
    BACKWARD_WEIGHT). The weights are a chunk's bytes per micro-batch (default: 1 held, 0
    deferred, i.e. `peak_inflight`'s count), so chunks of unequal size (interleaving: the first
    chunk has the embedding, the last the head) are weighed as they are, not rounded up to whole
    stages. The peak is looked for after each FORWARD and each BACKWARD_INPUT."""
    hw = held_weight or (lambda v: 1.0)
    dw = deferred_weight or (lambda v: 0.0)
    out = []
    for acts in schedule.actions:
        held = deferred = 0.0
        best = (0.0, 0.0)
        for a in acts:
            if a.op == Op.FORWARD:
                held += hw(a.stage)
            elif a.op == Op.BACKWARD_INPUT:
                deferred += dw(a.stage)
            elif a.op in _WEIGHT_GRAD:
                held -= hw(a.stage)
                if a.op == Op.BACKWARD_WEIGHT:
                    deferred -= dw(a.stage)
                continue
            else:
                continue
            if held + deferred > sum(best) + 1e-12:
                best = (held, deferred)
        out.append(best)
    return out


class _Executor:
    def __init__(self, schedule: Schedule, fifo: str):
        self.s = schedule
        self.pp = schedule.num_stages
        self.nv = schedule.num_virtual
        self.m = schedule.num_microbatches
        self.fifo = fifo
        if len(schedule.actions) != self.pp:
            raise ScheduleError(f"schedule has {len(schedule.actions)} stage lists, expected {self.pp}")
        self.pc = [0] * self.pp
        self.channels: dict[tuple, deque] = defaultdict(deque)
        self.received: list[set] = [set() for _ in range(self.pp)]
        self.forward: set[tuple[int, int]] = set()
        self.input_grad: set[tuple[int, int]] = set()   # B or BI done
        self.weight_grad: set[tuple[int, int]] = set()  # B or BW done
        self.split: set[tuple[int, int]] = set()        # done with BI (expects a BW)
        self.allreduce = [0] * self.pp
        self.optimizer = [0] * self.pp

    def fail(self, p: int, a: Action, why: str) -> None:
        raise ScheduleError(f"{self.s.kind} schedule, stage {p}, action #{self.pc[p]} {a}: {why}")

    def channel(self, src_v: int, dst_v: int, kind: str) -> tuple:
        if self.fifo == "physical":
            return (src_v % self.pp, dst_v % self.pp, kind)
        return (src_v, dst_v, kind)

    def run(self) -> None:
        for p, acts in enumerate(self.s.actions):
            for i, a in enumerate(acts):
                if a.stage % self.pp != p and a.op not in (Op.ALLREDUCE, Op.OPTIMIZER):
                    raise ScheduleError(f"{self.s.kind} schedule, stage {p}, action #{i} {a}: virtual stage "
                                     f"{a.stage} lives on physical stage {a.stage % self.pp}")
                if a.op not in (Op.ALLREDUCE, Op.OPTIMIZER, Op.PREFILL) and not (
                        0 <= a.stage < self.nv and 0 <= a.mb < self.m):
                    raise ScheduleError(f"{self.s.kind} schedule, stage {p}, action #{i} {a}: stage or "
                                     f"micro-batch out of range ({self.nv} virtual stages, {self.m} micro-batches)")
        while True:
            progress = False
            for p in range(self.pp):
                while self.pc[p] < len(self.s.actions[p]) and self.step(p, self.s.actions[p][self.pc[p]]):
                    self.pc[p] += 1
                    progress = True
            if all(self.pc[p] == len(self.s.actions[p]) for p in range(self.pp)):
                break
            if not progress:
                blocked = ", ".join(f"stage {p} at #{self.pc[p]} {self.s.actions[p][self.pc[p]]}"
                                    for p in range(self.pp) if self.pc[p] < len(self.s.actions[p]))
                raise ScheduleError(f"{self.s.kind} schedule deadlocks: {blocked}")
        self.finish()

    def step(self, p: int, a: Action) -> bool:
        """Execute one action; False if it must wait for a transfer."""
        v, mb, key = a.stage, a.mb, (a.stage, a.mb)
        if a.op == Op.FORWARD:
            if key in self.forward:
                self.fail(p, a, "second forward of this micro-batch")
            if v > 0:
                self.take_input(p, a, v - 1, "act", self.forward)
            self.forward.add(key)
        elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            if key not in self.forward:
                self.fail(p, a, "backward before the forward of this micro-batch")
            if key in self.input_grad:
                self.fail(p, a, "second backward of this micro-batch")
            if v < self.nv - 1:
                self.take_input(p, a, v + 1, "grad", self.input_grad)
            self.input_grad.add(key)
            if a.op == Op.BACKWARD:
                self.weight_grad.add(key)
            else:
                self.split.add(key)
        elif a.op == Op.BACKWARD_WEIGHT:
            if key not in self.split:
                self.fail(p, a, "weight gradient without an earlier BACKWARD_INPUT on this stage")
            if key in self.weight_grad:
                self.fail(p, a, "second weight gradient of this micro-batch")
            self.weight_grad.add(key)
        elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
            act = a.op == Op.SEND_ACT
            if a.peer != (v + 1 if act else v - 1):
                self.fail(p, a, f"sends to virtual stage {a.peer}, expected {v + 1 if act else v - 1}")
            if a.peer % self.pp == p:
                self.fail(p, a, "transfer to a virtual stage on the same physical stage")
            if key not in (self.forward if act else self.input_grad):
                self.fail(p, a, "sends a tensor this stage has not computed yet")
            self.channels[self.channel(v, a.peer, "act" if act else "grad")].append((v, a.peer, mb))
        elif a.op in (Op.RECV_ACT, Op.RECV_GRAD):
            act = a.op == Op.RECV_ACT
            if a.peer != (v - 1 if act else v + 1):
                self.fail(p, a, f"receives from virtual stage {a.peer}, expected {v - 1 if act else v + 1}")
            q = self.channels[self.channel(a.peer, v, "act" if act else "grad")]
            if not q:
                return False
            if q[0] != (a.peer, v, mb):
                src, dst, m = q[0]
                self.fail(p, a, f"receives out of order: the sender sent micro-batch {m} for virtual "
                                f"stage {dst} (from {src}) first on this channel")
            q.popleft()
            self.received[p].add(("act" if act else "grad", v, mb))
        elif a.op == Op.ALLREDUCE:
            missing = [(v, mb) for v in range(p, self.nv, self.pp) for mb in range(self.m)
                       if (v, mb) not in self.weight_grad]
            if missing:
                self.fail(p, a, f"gradient reduction before the weight gradient of virtual stage {missing[0][0]} "
                                f"micro-batch {missing[0][1]} ({len(missing)} missing)")
            self.allreduce[p] += 1
        elif a.op == Op.OPTIMIZER:
            if self.allreduce[p] != 1:
                self.fail(p, a, "optimizer step without a preceding gradient reduction")
            self.optimizer[p] += 1
        return True

    def take_input(self, p: int, a: Action, src_v: int, kind: str, local_done: set) -> None:
        """The tensor from virtual stage src_v: computed here earlier, or received earlier."""
        if src_v % self.pp == p:
            if (src_v, a.mb) not in local_done:
                self.fail(p, a, f"needs virtual stage {src_v}'s result, computed later on this stage")
            return
        tag = (kind, a.stage, a.mb)
        if tag not in self.received[p]:
            what = "activation" if kind == "act" else "gradient"
            self.fail(p, a, f"needs the {what} from virtual stage {src_v} but no earlier receive got it")
        self.received[p].discard(tag)

    def finish(self) -> None:
        for (src, dst, kind), q in self.channels.items():
            if q:
                raise ScheduleError(f"{self.s.kind} schedule: {len(q)} {kind} transfer(s) {src}->{dst} sent but "
                                 f"never received (first: {q[0]})")
        for v in range(self.nv):
            for mb in range(self.m):
                for done, what in ((self.forward, "forward"), (self.input_grad, "backward"),
                                   (self.weight_grad, "weight gradient")):
                    if (v, mb) not in done:
                        raise ScheduleError(f"{self.s.kind} schedule: virtual stage {v} micro-batch {mb} has no {what}")
        for p in range(self.pp):
            if self.received[p]:
                raise ScheduleError(f"{self.s.kind} schedule, stage {p}: received but never used: "
                                 f"{sorted(self.received[p])[:3]}")
            if self.allreduce[p] != 1 or self.optimizer[p] != 1:
                raise ScheduleError(f"{self.s.kind} schedule, stage {p}: needs exactly one ALLREDUCE and one "
                                 f"OPTIMIZER, has {self.allreduce[p]} and {self.optimizer[p]}")
