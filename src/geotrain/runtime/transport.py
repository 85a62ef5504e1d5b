"""Point-to-point tensor transport between ranks of different pipeline stages (contract: "Runtime transport").

The pipeline interpreter moves activations and gradients only through a `Transport`, so the
WAN helper can plug in a striped multi-connection transport (several TCP connections per
transfer) and temporal ordering for cross-DC pairs without touching the interpreter.

Rules every implementation follows:
  * `send` and `recv` are non-blocking and return a `Work` whose `.wait()` blocks until the
    transfer is complete (for `recv`: until `tensor` holds the data);
  * `recv` fills the caller's preallocated `tensor` in place (shape and dtype agreed in advance);
  * messages between one (src, dst) pair with the same `tag` are delivered in the order sent;
    different tags may be matched independently (gloo honours tags; NCCL matches in posting
    order, which the interpreter respects by posting in schedule order);
  * tensors only: nothing received is ever unpickled.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist


@runtime_checkable
class Work(Protocol):
    def wait(self) -> object: ...


@runtime_checkable
class Transport(Protocol):
    """Point-to-point tensor transport between ranks of different stages."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work: ...

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work: ...


class _Done:
    """A Work that is already complete (e.g. a local copy)."""

    def wait(self) -> bool:
        return True


class TorchTransport:
    """The default transport: torch.distributed isend/irecv (gloo on CPU, NCCL on GPUs).

    `group` is the process group the peers are addressed in (global ranks; default: world)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        if dst == dist.get_rank():
            raise ValueError("a transport sends only to other ranks")
        return dist.isend(tensor.contiguous(), dst=dst, group=self.group, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        return dist.irecv(tensor, src=src, group=self.group, tag=tag)


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


def make_tag(kind: int, src_virtual_stage: int, mb: int, num_virtual: int, num_microbatches: int) -> int:
    """A tag unique within one iteration for (kind, sending virtual stage, micro-batch).

    kind: 0 for activations, 1 for gradients. Tags repeat across iterations, which is fine
    because transfers with one tag are delivered in order."""
    return (kind * num_virtual + src_virtual_stage) * num_microbatches + mb


__all__ = ["RoutedTransport", "Transport", "TorchTransport", "Work", "make_tag"]
