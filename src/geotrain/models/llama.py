"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) in plain PyTorch.

The model is a flat sequence of *units* -- embedding, `layers` blocks, final norm + head -- so a
pipeline stage is just a contiguous slice of units (`build_units`), and the full model is the
slice covering all of them. Nothing here knows about processes, devices or sharding, nor about
specs: `spec` is a `ModelShape` (or anything with its fields, such as a validated config `ModelSpec`).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from geotrain.models.shape import ModelShape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rope_tables(spec: ModelShape, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    half = spec.head_dim // 2
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    t = torch.arange(spec.seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); rotate the two halves of the head dimension.
    T = x.shape[-2]
    cos, sin = cos[:T].to(x.dtype), sin[:T].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelShape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.wq = nn.Linear(spec.hidden, spec.heads * spec.head_dim, bias=False)
        self.wk = nn.Linear(spec.hidden, spec.kv_heads * spec.head_dim, bias=False)
        self.wv = nn.Linear(spec.hidden, spec.kv_heads * spec.head_dim, bias=False)
        self.wo = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, spec: ModelShape):
        super().__init__()
        self.w_gate = nn.Linear(spec.hidden, spec.ffn, bias=False)
        self.w_up = nn.Linear(spec.hidden, spec.ffn, bias=False)
        self.w_down = nn.Linear(spec.ffn, spec.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, spec: ModelShape):
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.attn = Attention(spec)
        self.ffn_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.ffn = FeedForward(spec)
        self.spec = spec
        cos, sin = rope_tables(spec)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Recompute the RoPE tables in place (after a module built on the meta device got storage)."""
        cos, sin = rope_tables(self.spec)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), self.rope_cos, self.rope_sin)
        return x + self.ffn(self.ffn_norm(x))


class Embedding(nn.Module):
    """Token embedding. Its output -- the residual stream -- is fp32 whatever dtype the weights are
    held in (16-bit weights give a 16-bit lookup, cast up here; fp32 weights: no copy), so the
    additions of every block stay in fp32."""

    def __init__(self, spec: ModelShape):
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens).float()


class Head(nn.Module):
    def __init__(self, spec: ModelShape):
        super().__init__()
        self.norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.out = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_unit(spec: ModelShape, index: int) -> nn.Module:
    """Unit 0 is the embedding, 1..layers are blocks, layers+1 is the final norm and head."""
    if index == 0:
        return Embedding(spec)
    if index == spec.layers + 1:
        return Head(spec)
    if 1 <= index <= spec.layers:
        return Block(spec)
    raise IndexError(f"unit {index} out of range 0..{spec.layers + 1}")


INIT_SEED = 1234
INIT_BLOCK_ROWS = 64  # rows drawn from one generator: the granularity at which a slice is drawn alone


def init_std(spec: ModelShape, name: str) -> float | None:
    """The initial weights' normal std for parameter `name` of a unit ("attn.wo.weight"), or None
    for a vector (RMSNorm weights: ones). Output projections get std / sqrt(2 * layers)."""
    if name.endswith("norm.weight"):
        return None
    return 0.02 / math.sqrt(2 * spec.layers) if name.endswith(("wo.weight", "w_down.weight")) else 0.02


def _block_seed(unit_index: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{unit_index}:{name}:{block}".encode(), digest_size=8).digest()
    return INIT_SEED + int.from_bytes(digest, "little") % 2**62


def initial_rows(spec: ModelShape, unit_index: int, name: str, shape: tuple[int, ...], start: int = 0,
                 stop: int | None = None) -> torch.Tensor:
    """Rows [start, stop) of the initial value of parameter `name` of unit `unit_index` (fp32, CPU),
    drawn without drawing the rest of the tensor.

    The value is a pure function of the unit index, the parameter's name (which never depend on how
    the model is cut or sharded) and its shape: each run of INIT_BLOCK_ROWS rows comes from its own
    generator, seeded by (unit, name, block). So a stage equals the same slice of the whole model,
    and any shard of a parameter -- rows, or columns of rows -- can be materialised on its own."""
    stop = shape[0] if stop is None else stop
    out = torch.empty((stop - start, *shape[1:]), dtype=torch.float32)
    std = init_std(spec, name)
    if std is None:
        return out.fill_(1.0)
    for block in range(start // INIT_BLOCK_ROWS, -(-stop // INIT_BLOCK_ROWS)):
        a = block * INIT_BLOCK_ROWS
        b = min(a + INIT_BLOCK_ROWS, shape[0])
        g = torch.Generator().manual_seed(_block_seed(unit_index, name, block))
        values = torch.randn((b - a, *shape[1:]), generator=g).mul_(std)
        lo, hi = max(a, start), min(b, stop)
        out[lo - start:hi - start].copy_(values[lo - a:hi - a])
    return out


@torch.no_grad()
def init_weights(module: nn.Module, spec: ModelShape, unit_index: int) -> None:
    """Deterministic per-parameter init (`initial_rows`): a stage built alone gets the same weights
    as the same units inside the full model."""
    for name, p in module.named_parameters():
        p.copy_(initial_rows(spec, unit_index, name, tuple(p.shape)))


class UnitStack(nn.Module):
    """A contiguous slice [start, end) of the model's units, run in order.

    `units` is an nn.ModuleDict keyed by the global unit index (as a string) so parameter names
    -- and thus checkpoints -- are the same whether the model is whole or cut into stages."""

    def __init__(self, spec: ModelShape, start: int, end: int, init: bool = True):
        super().__init__()
        if not 0 <= start < end <= spec.num_units:
            raise ValueError(f"bad unit range [{start}, {end}) for {spec.num_units} units")
        self.spec, self.start, self.end = spec, start, end
        self.units = nn.ModuleDict()
        for i in range(start, end):
            unit = build_unit(spec, i)
            if init:
                init_weights(unit, spec, i)
            self.units[str(i)] = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units.values():
            x = unit(x)
        return x

    def tie_head_to_embedding(self) -> None:
        """Make the head's output matrix the embedding's Parameter (a tied model -- one matrix for
        both -- when this slice holds both ends). Parameter listings then name it once, as
        `units.0.tok.weight`."""
        if not (self.has_embedding and self.has_head):
            raise ValueError(f"units [{self.start}, {self.end}) do not hold both the embedding and the head")
        self.units[str(self.end - 1)].out.weight = self.units["0"].tok.weight

    @property
    def has_embedding(self) -> bool:
        return self.start == 0

    @property
    def has_head(self) -> bool:
        return self.end == self.spec.num_units


def build_units(spec: ModelShape, start: int = 0, end: int | None = None, init: bool = True) -> UnitStack:
    """Units [start, end). `init=False` leaves the parameters as created: built under
    `torch.device("meta")` they hold no storage until the caller materialises them (`initial_rows`
    gives each parameter's values, `Block.reset_rope` the buffers)."""
    return UnitStack(spec, start, spec.num_units if end is None else end, init)


def build_model(spec: ModelShape) -> UnitStack:
    """The whole model: tokens (B, T) -> logits (B, T, vocab)."""
    return build_units(spec)
