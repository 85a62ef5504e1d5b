"""A symbolic run of a schedule over an in-order transport (NCCL semantics), with the runtime's posting.

The model is deliberately the strictest a real transport may be: per rank, posted batches run in
order on a stream (one for everything, or one per direction of each pair, as the runtime's
`TorchTransport` has); matching ignores tags, so the k-th send a -> b meets b's k-th receive from a
and must be the same tensor; sends and receives rendezvous without buffering; the rank posts where
`posting.post_points` says and blocks at RECV and at OPTIMIZER (for its sends). NCCL is at most
this strict, so a schedule that completes here completes there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from geotrain.schedule.actions import Op, Schedule
from geotrain.schedule.posting import RECVS, post_points
from geotrain.schedule.schedule_error import ScheduleError


@dataclass(eq=False)
class _Op:
    rank: int
    index: int                 # action index on its rank
    send: bool
    peer: int
    what: tuple                # ("act"|"grad", sending virtual stage, micro-batch)
    k: int = 0                 # k-th operation of its direction on this (src, dst) pair
    done: bool = False


@dataclass
class _Rank:
    streams: dict = field(default_factory=dict)     # stream key -> deque of batches (lists of _Op)
    by_index: dict = field(default_factory=dict)    # action index -> _Op
    sends: list = field(default_factory=list)
    pc: int = 0
    posted_at: int = -1        # the action index whose batches were posted last


STREAMS = ("shared", "directed")


def check_in_order(schedule: Schedule, lookahead: int | None = None, streams: str = "directed") -> None:
    """Raise ScheduleError if `schedule`, posted as `posting.post_points(lookahead)` says, deadlocks or
    mismatches over an in-order, rendezvous transport with the given stream layout.

    One rank per physical stage (a pipeline's replicas never talk to each other). streams="shared":
    ONE stream for all its point-to-point traffic (one communicator for every pair and direction);
    "directed": one per direction of each neighbour pair (the runtime's TorchTransport). A batch
    starts when every earlier batch of its stream completed, and completes when all its operations
    did. With directed streams each stream carries one direction of one pair, so it completes
    whenever the tensors' order per direction agrees on both ends -- with any look-ahead."""
    if streams not in STREAMS:
        raise ScheduleError(f"streams must be one of {STREAMS}, got {streams!r}")
    pp = schedule.num_stages
    ranks = [_Rank() for _ in range(pp)]
    posts = [post_points(acts, lookahead) for acts in schedule.actions]
    counters: dict[tuple[int, int, bool], int] = {}
    pending: dict[tuple[int, int, int, bool], _Op] = {}       # (src, dst, k, is_send) -> op

    def key(op: _Op) -> tuple:
        return () if streams == "shared" else ((op.rank, op.peer) if op.send else (op.peer, op.rank))

    def post(p: int, batch: list[int]) -> None:
        by_stream: dict[tuple, list[_Op]] = {}
        for i in batch:
            a = schedule.actions[p][i]
            send = a.op not in RECVS
            peer = a.peer % pp
            kind = "act" if a.op in (Op.SEND_ACT, Op.RECV_ACT) else "grad"
            what = (kind, a.stage if send else a.peer, a.mb)
            src, dst = (p, peer) if send else (peer, p)
            k = counters.get((src, dst, send), 0)
            counters[(src, dst, send)] = k + 1
            op = _Op(p, i, send, peer, what, k)
            other = pending.get((src, dst, k, not send))
            if other is not None and other.what != op.what:
                s, r = (op, other) if send else (other, op)
                raise ScheduleError(
                    f"{schedule.kind} schedule: in-order transport pairs send #{k} {src}->{dst} "
                    f"({s.what[0]} of virtual stage {s.what[1]} mb {s.what[2]}) with a receive of "
                    f"{r.what[0]} of virtual stage {r.what[1]} mb {r.what[2]}: the two ends post in different orders")
            pending[(src, dst, k, send)] = op
            ranks[p].by_index[i] = op
            if send:
                ranks[p].sends.append(op)
            by_stream.setdefault(key(op), []).append(op)
        for k_, ops in by_stream.items():     # a batch spanning streams: its part on each, in order
            ranks[p].streams.setdefault(k_, deque()).append(ops)

    def running(op: _Op) -> bool:
        stream = ranks[op.rank].streams.get(key(op))
        return bool(stream) and any(o is op for o in stream[0])

    def advance_program(p: int) -> bool:
        r, acts, moved = ranks[p], schedule.actions[p], False
        while r.pc < len(acts):
            a = acts[r.pc]
            if r.posted_at != r.pc:
                for batch in posts[p][r.pc]:
                    post(p, batch)
                r.posted_at = r.pc
                moved = True
            if a.op in RECVS and not r.by_index[r.pc].done:
                return moved
            if a.op == Op.OPTIMIZER and not all(o.done for o in r.sends):
                return moved
            r.pc += 1
            moved = True
        return moved

    def advance_streams() -> bool:
        moved = False
        for p in range(pp):
            for stream in ranks[p].streams.values():
                while stream:
                    for op in stream[0]:
                        if op.done:
                            continue
                        src, dst = (p, op.peer) if op.send else (op.peer, p)
                        other = pending.get((src, dst, op.k, not op.send))
                        if other is not None and running(other):
                            op.done = other.done = True
                            moved = True
                    if all(o.done for o in stream[0]):
                        stream.popleft()
                        moved = True
                    else:
                        break
        return moved

    while True:
        moved = False
        for p in range(pp):
            moved |= advance_program(p)
        moved |= advance_streams()
        if all(ranks[p].pc == len(schedule.actions[p]) for p in range(pp)):
            return
        if not moved:
            blocked = []
            for p in range(pp):
                if ranks[p].pc < len(schedule.actions[p]):
                    heads = ", ".join(str(schedule.actions[p][o.index]) for st in ranks[p].streams.values()
                                      if st for o in st[0] if not o.done)
                    blocked.append(f"stage {p} at #{ranks[p].pc} {schedule.actions[p][ranks[p].pc]} "
                                   f"(stream head: {heads or 'empty'})")
            how = "grouped posting" if lookahead is None else f"receives posted {lookahead} ahead"
            how += f", {streams} streams"
            raise ScheduleError(f"{schedule.kind} schedule deadlocks on an in-order transport ({how}): "
                                + "; ".join(blocked))


__all__ = ["check_in_order"]
