"""Point-to-point tensor transport between ranks of different pipeline stages (contract: "Runtime transport").

The pipeline interpreter moves activations and gradients only through a `Transport`, so the
WAN helper can plug in a striped multi-connection transport (several TCP connections per
transfer) and temporal ordering for cross-DC pairs without touching the interpreter.

Rules every implementation follows:
  * `send` and `recv` are non-blocking and return a `Work` whose `.wait()` blocks until the
    transfer is complete (for `recv`: until `tensor` holds the data);
  * `recv` fills the caller's preallocated `tensor` in place (shape and dtype agreed in advance);
  * messages between one (src, dst) pair with the same `tag` are delivered in the order sent;
    different tags may be matched independently (gloo honours tags). NCCL ignores tags and runs a
    communicator's operations in posting order, a large send waiting for its receive: so
    `TorchTransport` sends each direction of each neighbour-stage pair in a process group of its
    own (`directed_groups`), where posting order per direction is the schedule's send order on
    one end and its receive order on the other -- the same order (`schedule.inorder` proves it for
    the interpreter's look-ahead), so nothing can wait on a later message;
  * tensors only: nothing received is ever unpickled.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from geotrain.runtime.meshes import reused_groups


@runtime_checkable
class Work(Protocol):
    def wait(self) -> object: ...


@runtime_checkable
class Transport(Protocol):
    """Point-to-point tensor transport between ranks of different stages."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work: ...

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work: ...


class TorchTransport:
    """The default transport: torch.distributed isend/irecv (gloo on CPU, NCCL on GPUs).

    `groups[(src, dst)]` is the process group that carries src -> dst (global ranks), from
    `directed_groups`; a pair not listed uses `group` (default: world)."""

    def __init__(self, group: dist.ProcessGroup | None = None,
                 groups: dict[tuple[int, int], dist.ProcessGroup] | None = None):
        self.group = group
        self.groups = dict(groups or {})
        self.rank = dist.get_rank()

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        if dst == self.rank:
            raise ValueError("a transport sends only to other ranks")
        return dist.isend(tensor.contiguous(), dst=dst, group=self.groups.get((self.rank, dst), self.group), tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        return dist.irecv(tensor, src=src, group=self.groups.get((src, self.rank), self.group), tag=tag)


def stage_directions(schedule) -> list[tuple[int, int]]:
    """(sending physical stage, receiving physical stage) of every boundary transfer of the schedule, sorted."""
    pp = schedule.num_stages
    return sorted({(s, a.peer % pp) for s, acts in enumerate(schedule.actions) for a in acts
                   if a.op.is_comm and a.op.value.startswith("send") and a.peer % pp != s})


def direction_pairs(plan, schedule) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Per direction between two neighbouring stages (sorted): the group's members (the ranks of
    both stages) and the (src rank, dst rank) pairs it carries -- to replica d, TP index t' of the
    receiving stage from the same replica's TP index t' mod tp of the sending one (the pipeline's
    pairing; with one tp: (d, t) to (d, t)), so inside a group each receiver has one sender and
    each pair one direction."""
    out = []
    for a, b in stage_directions(schedule):
        members = sorted(plan.rank(s, d, t) for s in (a, b) for d in range(plan.dp) for t in range(plan.stage_tp(s)))
        pairs = [(plan.rank(a, d, t % plan.stage_tp(a)), plan.rank(b, d, t))
                 for d in range(plan.dp) for t in range(plan.stage_tp(b))]
        out.append((members, pairs))
    return out


def directed_groups(plan, schedule) -> dict[tuple[int, int], dist.ProcessGroup]:
    """One process group per direction between neighbouring stages (`direction_pairs`); returns
    {(src rank, dst rank): group} for the pairs this rank is in. Collective: every rank calls it, in
    the same order. A backend that runs all of a group's operations on one stream (NCCL) then
    keeps them in the order both ends posted them."""
    me = dist.get_rank()
    out: dict[tuple[int, int], dist.ProcessGroup] = {}
    directions = direction_pairs(plan, schedule)
    for (_, pairs), group in zip(directions, reused_groups("p2p", [list(m) for m, _ in directions])):
        out.update({pair: group for pair in pairs if me in pair})
    return out


class RoutedTransport:
    """One transport per peer: `per_peer[rank]` where given, else `default`.

    How the runtime sends cross-DC pairs over the WAN transport (striped, shaped, taking turns)
    while pairs inside a DC keep gloo -- the interpreter sees one Transport and stays unchanged."""

    def __init__(self, default: Transport, per_peer: dict[int, Transport] | None = None, also_close=()):
        self.default = default
        self.per_peer = dict(per_peer or {})
        self.also_close = list(also_close)      # helpers living as long as the transports (turn arbiters)

    def route(self, peer: int) -> Transport:
        return self.per_peer.get(peer, self.default)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        return self.route(dst).send(tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        return self.route(src).recv(tensor, src, tag)

    def close(self) -> None:
        """Close every distinct transport that has a `close` (each once)."""
        seen: set[int] = set()
        for t in (self.default, *self.per_peer.values(), *self.also_close):
            if id(t) not in seen and hasattr(t, "close"):
                seen.add(id(t))
                t.close()


class HostStaging:
    """A transport that moves host memory (the striped WAN transport: sockets), for a rank whose
    tensors live on a GPU: a send copies the tensor into a pinned host buffer asynchronously and
    hands that buffer over once the copy (and the compute before it on the stream) is done; a
    receive lands in a pinned buffer and is copied to the device, stream-ordered, at `wait()`.
    CPU tensors pass straight through, so a CPU rank runs exactly the inner transport."""

    def __init__(self, inner: Transport):
        self.inner = inner

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        if tensor.device.type == "cpu":
            return self.inner.send(tensor, dst, tag)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(tensor.device))
        done.synchronize()                   # the bytes are in host memory before the sockets read them
        return self.inner.send(host, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        if tensor.device.type == "cpu":
            return self.inner.recv(tensor, src, tag)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return _CopyToDevice(self.inner.recv(host, src, tag), host, tensor)

    def close(self) -> None:
        if hasattr(self.inner, "close"):
            self.inner.close()


class _CopyToDevice:
    def __init__(self, work: Work, host: torch.Tensor, target: torch.Tensor):
        self.work, self.host, self.target = work, host, target

    def wait(self) -> bool:
        self.work.wait()
        self.target.copy_(self.host, non_blocking=True)   # ordered before the compute that reads it
        return True


def make_tag(kind: int, src_virtual_stage: int, mb: int, num_virtual: int, num_microbatches: int) -> int:
    """A tag unique within one iteration for (kind, sending virtual stage, micro-batch).

    kind: 0 for activations, 1 for gradients. Tags repeat across iterations, which is fine
    because transfers with one tag are delivered in order."""
    return (kind * num_virtual + src_virtual_stage) * num_microbatches + mb


__all__ = ["HostStaging", "RoutedTransport", "Transport", "TorchTransport", "Work", "direction_pairs",
           "directed_groups", "make_tag", "stage_directions"]
