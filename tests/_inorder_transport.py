"""A strict in-order transport for tests: NCCL's point-to-point semantics, in one process.

Ranks run as threads. Each rank has streams of posted operations; an operation runs only when
every earlier operation of its stream completed; tags are ignored (the k-th send a->b meets the
k-th receive b posted from a -- a mismatch is an error, as NCCL would silently deliver the wrong
tensor); a send completes only when its receive is running and vice versa (no buffering). A stuck
wait raises `Deadlock` after `timeout_s`.

`streams="shared"`: one stream per rank (everything on one communicator); "directed": one per
(src, dst) direction, what `TorchTransport`'s per-direction process groups give.
"""

from __future__ import annotations

import threading
from collections import deque

import torch


class Deadlock(RuntimeError):
    pass


class _Op:
    def __init__(self, rank, send, peer, tensor, tag, k):
        self.rank, self.send, self.peer, self.tensor, self.tag, self.k = rank, send, peer, tensor, tag, k
        self.done = False
        self.finished_at = None


class InOrderHub:
    def __init__(self, streams: str = "directed", timeout_s: float = 10.0):
        assert streams in ("shared", "directed")
        self.streams, self.timeout_s = streams, timeout_s
        self.cv = threading.Condition()
        self.queues: dict[tuple, deque] = {}
        self.count: dict[tuple, int] = {}
        self.pending: dict[tuple, _Op] = {}
        self.error: BaseException | None = None

    def transport(self, rank: int) -> InOrderTransport:
        return InOrderTransport(self, rank)

    def _key(self, op: _Op) -> tuple:
        src, dst = (op.rank, op.peer) if op.send else (op.peer, op.rank)
        return (op.rank,) if self.streams == "shared" else (op.rank, src, dst)

    def post(self, rank: int, send: bool, peer: int, tensor: torch.Tensor, tag: int) -> _Work:
        with self.cv:
            src, dst = (rank, peer) if send else (peer, rank)
            k = self.count.get((src, dst, send), 0)
            self.count[(src, dst, send)] = k + 1
            op = _Op(rank, send, peer, tensor, tag, k)
            self.pending[(src, dst, k, send)] = op
            self.queues.setdefault(self._key(op), deque()).append(op)
            self._progress()
            return _Work(self, op)

    def _running(self, op: _Op) -> bool:
        q = self.queues.get(self._key(op))
        return bool(q) and q[0] is op

    def _progress(self) -> None:
        moved = True
        while moved:
            moved = False
            for q in self.queues.values():
                if not q:
                    continue
                op = q[0]
                src, dst = (op.rank, op.peer) if op.send else (op.peer, op.rank)
                other = self.pending.get((src, dst, op.k, not op.send))
                if other is None or not self._running(other):
                    continue
                s, r = (op, other) if op.send else (other, op)
                if s.tag != r.tag or s.tensor.shape != r.tensor.shape or s.tensor.dtype != r.tensor.dtype:
                    self.error = AssertionError(f"in-order matching paired send tag {s.tag} {src}->{dst} with "
                                                f"receive tag {r.tag}: the ends posted in different orders")
                else:
                    r.tensor.copy_(s.tensor)
                for o in (s, r):
                    o.done = True
                    self.queues[self._key(o)].popleft()
                del self.pending[(src, dst, op.k, True)], self.pending[(src, dst, op.k, False)]
                moved = True
        self.cv.notify_all()


class _Work:
    def __init__(self, hub: InOrderHub, op: _Op):
        self.hub, self.op = hub, op

    def wait(self) -> bool:
        with self.hub.cv:
            if not self.hub.cv.wait_for(lambda: self.op.done or self.hub.error is not None, self.hub.timeout_s):
                self.hub.error = Deadlock(f"rank {self.op.rank}: {'send to' if self.op.send else 'receive from'} "
                                          f"{self.op.peer} (tag {self.op.tag}) never completed")
                self.hub.cv.notify_all()     # the other ranks stop waiting too
            if self.hub.error is not None:
                raise self.hub.error
        return True


class InOrderTransport:
    def __init__(self, hub: InOrderHub, rank: int):
        self.hub, self.rank = hub, rank

    def send(self, tensor, dst, tag):
        return self.hub.post(self.rank, True, dst, tensor, tag)

    def recv(self, tensor, src, tag):
        return self.hub.post(self.rank, False, src, tensor, tag)
