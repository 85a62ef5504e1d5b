"""Compressed tensors on the wire: pipeline boundaries across a WAN link and DiLoCo's outer gradients.

Every payload is a flat uint8 tensor of exactly the size `costs.compression` counts (the one
definition the simulator, the planner and the WAN byte totals read), laid out scales first (fp32,
so every view is aligned), then the values:
  * boundaries (`encode_boundary`): the tensor cut into rows of `row` elements (the hidden size);
    bf16 values, or fp8 (e4m3 / e5m2) / int8 values with one absmax scale per row; or a rank-r
    factorisation of the rows x row matrix (torch.svd_lowrank, in its own RNG stream so training's
    is untouched) as two bf16 factors;
  * outer gradients (`encode_outer`): fp32, bf16, or int8 / int4 (two per byte) with one absmax
    scale per block of costs.compression.OUTER_BLOCK values.
`CompressedTransport` wraps a Transport: a send encodes, a receive posts a payload buffer of the
known size and decodes into the caller's tensor at wait() -- the interpreter is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from geotrain.costs.compression import (
    OUTER_BLOCK,
    SCALE_BYTES,
    boundary_wire_bytes,
    outer_wire_bytes,
    rows_of,
)
from geotrain.runtime.p2p import Transport, Work

_FP8 = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}
_TINY = 1e-30


def _matrix(t: torch.Tensor, row: int) -> torch.Tensor:
    """`t` flattened in fp32, zero-padded to whole rows, as rows x row."""
    flat = t.detach().reshape(-1).float()
    rows = rows_of(flat.numel(), row)
    return F.pad(flat, (0, rows * row - flat.numel())).view(rows, row)


def _bytes(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


def _scaled(m: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(m / scale, scale): one absmax scale per row mapping the row onto [-top, top]."""
    scale = (m.abs().amax(dim=1, keepdim=True) / top).clamp_min(_TINY)
    return m / scale, scale


def encode_boundary(t: torch.Tensor, codec: str, row: int, rank: int = 0) -> torch.Tensor:
    """The payload of boundary tensor `t` (see the module docstring)."""
    n = t.numel()
    if rank > 0:
        m = _matrix(t, row)
        r = min(rank, m.shape[0], m.shape[1])
        devices = [m.device] if m.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            u, s, v = torch.svd_lowrank(m, q=r, niter=2)
        out = _bytes((u * s).to(torch.bfloat16), v.T.contiguous().to(torch.bfloat16))
    elif codec == "none":
        out = _bytes(t.detach())
    elif codec == "bf16":
        out = _bytes(t.detach().to(torch.bfloat16))
    else:
        m = _matrix(t, row)
        if codec == "int8":
            q, scale = _scaled(m, 127.0)
            vals = q.round().clamp(-127, 127).to(torch.int8)
        else:
            q, scale = _scaled(m, float(torch.finfo(_FP8[codec]).max))
            vals = q.to(_FP8[codec])
        out = _bytes(scale.float(), vals.reshape(-1)[:n])
    assert out.numel() == boundary_wire_bytes(n, t.element_size(), codec, row, rank), "codec and cost disagree"
    return out


def decode_boundary(payload: torch.Tensor, out: torch.Tensor, codec: str, row: int, rank: int = 0) -> None:
    """Fill `out` (shape and dtype known to the receiver) from `payload`."""
    n = out.numel()
    if rank > 0:
        rows = rows_of(n, row)
        r = min(rank, rows, row)
        a = payload[:rows * r * 2].view(torch.bfloat16).view(rows, r).float()
        b = payload[rows * r * 2:].view(torch.bfloat16).view(r, row).float()
        out.copy_((a @ b).reshape(-1)[:n].view(out.shape))
    elif codec == "none":
        out.copy_(payload.view(out.dtype).view(out.shape))
    elif codec == "bf16":
        out.copy_(payload.view(torch.bfloat16).view(out.shape))
    else:
        rows = rows_of(n, row)
        scale = payload[:rows * SCALE_BYTES].view(torch.float32)
        raw = payload[rows * SCALE_BYTES:]
        vals = raw.view(torch.int8) if codec == "int8" else raw.view(_FP8[codec])
        m = F.pad(vals.float(), (0, rows * row - n)).view(rows, row) * scale[:, None]
        out.copy_(m.reshape(-1)[:n].view(out.shape))


def encode_outer(v: torch.Tensor, codec: str, block: int = OUTER_BLOCK) -> torch.Tensor:
    """The payload of a flat fp32 vector of outer gradients."""
    n = v.numel()
    if codec == "fp32":
        out = _bytes(v.float())
    elif codec == "bf16":
        out = _bytes(v.to(torch.bfloat16))
    else:
        top = 127.0 if codec == "int8" else 7.0
        q, scale = _scaled(_matrix(v, block), top)
        q = q.round().clamp(-top, top).reshape(-1)[:n]
        if codec == "int8":
            vals = q.to(torch.int8).view(torch.uint8)
        else:
            nib = F.pad((q + 8).to(torch.uint8), (0, n % 2), value=8)
            vals = nib[0::2] | (nib[1::2] << 4)
        out = _bytes(scale.float(), vals)
    assert out.numel() == outer_wire_bytes(n, codec, block), "codec and cost disagree"
    return out


def decode_outer(payload: torch.Tensor, n: int, codec: str, block: int = OUTER_BLOCK) -> torch.Tensor:
    """The fp32 vector of `n` values a payload of `encode_outer` carries."""
    if codec == "fp32":
        return payload.view(torch.float32).clone()
    if codec == "bf16":
        return payload.view(torch.bfloat16).float()
    blocks = rows_of(n, block)
    scale = payload[:blocks * SCALE_BYTES].view(torch.float32)
    raw = payload[blocks * SCALE_BYTES:]
    if codec == "int8":
        q = raw.view(torch.int8).float()
    else:
        q = torch.stack([(raw & 15), (raw >> 4)], dim=1).reshape(-1)[:n].float() - 8
    return (F.pad(q, (0, blocks * block - n)).view(blocks, block) * scale[:, None]).reshape(-1)[:n]


class _Decode:
    """A receive's Work: waits for the payload, then decodes it into the caller's tensor."""

    def __init__(self, work: Work, payload: torch.Tensor, out: torch.Tensor, codec: str, row: int, rank: int):
        self.work, self.payload, self.out = work, payload, out
        self.codec, self.row, self.rank = codec, row, rank
        self.wire_bytes = payload.numel()

    def wait(self) -> bool:
        self.work.wait()
        decode_boundary(self.payload, self.out, self.codec, self.row, self.rank)
        return True

    def is_completed(self) -> bool:
        done = getattr(self.work, "is_completed", None)
        return bool(done()) if done is not None else False


class _Sent:
    """A send's Work, saying how many bytes went on the wire (the interpreter's transfer events)."""

    def __init__(self, work: Work, wire_bytes: int):
        self.work, self.wire_bytes = work, wire_bytes

    def wait(self) -> object:
        return self.work.wait()

    def __getattr__(self, name: str):          # started_at / finished_at / is_completed of the inner Work
        return getattr(self.work, name)


class CompressedTransport:
    """Sends boundary tensors compressed by `codec` (rows of `row`; `rank` > 0: low-rank) over `inner`."""

    def __init__(self, inner: Transport, codec: str, row: int, rank: int = 0):
        self.inner, self.codec, self.row, self.rank = inner, codec, row, rank

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        payload = encode_boundary(tensor, self.codec, self.row, self.rank)
        return _Sent(self.inner.send(payload, dst, tag), payload.numel())

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        size = boundary_wire_bytes(tensor.numel(), tensor.element_size(), self.codec, self.row, self.rank)
        payload = torch.empty(size, dtype=torch.uint8, device=tensor.device)
        return _Decode(self.inner.recv(payload, src, tag), payload, tensor, self.codec, self.row, self.rank)

    def close(self) -> None:
        if hasattr(self.inner, "close"):
            self.inner.close()
