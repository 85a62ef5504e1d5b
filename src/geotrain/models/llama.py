"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) in plain PyTorch.

The model is a flat sequence of *units* -- embedding, `layers` blocks, final norm + head -- so a
pipeline stage is just a contiguous slice of units (`build_units`), and the full model is the
slice covering all of them. Nothing here knows about processes, devices or sharding, nor about
specs: `spec` is a `ModelShape` (or anything with its fields, such as a validated config `ModelSpec`).
"""

from __future__ import annotations

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
        cos, sin = rope_tables(spec)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), self.rope_cos, self.rope_sin)
        return x + self.ffn(self.ffn_norm(x))


class Embedding(nn.Module):
    def __init__(self, spec: ModelShape):
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens)


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


def init_weights(module: nn.Module, spec: ModelShape, unit_index: int) -> None:
    """Deterministic per-unit init (seeded by unit index), so a stage built alone gets the
    same weights as the same units inside the full model."""
    g = torch.Generator().manual_seed(1234 + unit_index)
    std = 0.02
    out_std = std / math.sqrt(2 * spec.layers)
    for name, p in module.named_parameters():
        with torch.no_grad():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                s = out_std if name.endswith(("wo.weight", "w_down.weight")) else std
                p.copy_(torch.randn(p.shape, generator=g) * s)


class UnitStack(nn.Module):
    """A contiguous slice [start, end) of the model's units, run in order.

    `units` is an nn.ModuleDict keyed by the global unit index (as a string) so parameter names
    -- and thus checkpoints -- are the same whether the model is whole or cut into stages."""

    def __init__(self, spec: ModelShape, start: int, end: int):
        super().__init__()
        if not 0 <= start < end <= spec.num_units:
            raise ValueError(f"bad unit range [{start}, {end}) for {spec.num_units} units")
        self.spec, self.start, self.end = spec, start, end
        self.units = nn.ModuleDict()
        for i in range(start, end):
            unit = build_unit(spec, i)
            init_weights(unit, spec, i)
            self.units[str(i)] = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units.values():
            x = unit(x)
        return x

    @property
    def has_embedding(self) -> bool:
        return self.start == 0

    @property
    def has_head(self) -> bool:
        return self.end == self.spec.num_units


def build_units(spec: ModelShape, start: int = 0, end: int | None = None) -> UnitStack:
    return UnitStack(spec, start, spec.num_units if end is None else end)


def build_model(spec: ModelShape) -> UnitStack:
    """The whole model: tokens (B, T) -> logits (B, T, vocab)."""
    return build_units(spec)
