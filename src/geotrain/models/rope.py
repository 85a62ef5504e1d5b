"""Rotary position tables for every rope_type transformers implements for these families.

The formulas are transformers' (`modeling_rope_utils`), computed the same way in fp32 so the
tables are bit-equal: default, linear, dynamic (NTK; equal to default for positions within
max_position_embeddings, which is all geotrain trains or serves), yarn, longrope and llama3.
YaRN and LongRoPE scale cos/sin by an attention factor. LongRoPE switches from its short to its
long factors once a sequence (or, decoding, the position reached) passes the original context:
the tables hold both sets (`variant`).
"""

from __future__ import annotations

import math

import torch

from geotrain.models.shape import ModelShape


def _base_inv_freq(base: float, dim: int, device=None) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))


def _original(shape: ModelShape, rope: dict) -> int:
    return int(rope.get("original_max_position_embeddings", shape.positions))


def _yarn(shape: ModelShape, rope: dict, dim: int, device) -> tuple[torch.Tensor, float]:
    base, factor = shape.rope_theta, rope["factor"]
    original = _original(shape, rope)

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1 - ramp.to(device=device, dtype=torch.float)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention


def inv_freq(shape: ModelShape, long: bool = False, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of the rotated dims, attention scaling of cos/sin); `long`: LongRoPE's
    long factors."""
    rope, dim, base = shape.rope, shape.rotary_dim, shape.rope_theta
    kind = rope["rope_type"]
    if kind == "default":
        return _base_inv_freq(base, dim, device), 1.0
    if kind == "linear":
        return _base_inv_freq(base, dim, device) / rope["factor"], 1.0
    if kind == "dynamic":
        seq, mpe, factor = shape.positions, shape.positions, rope["factor"]
        base = base * ((factor * seq / mpe) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim, device), 1.0
    if kind == "yarn":
        return _yarn(shape, rope, dim, device)
    if kind == "longrope":
        original = _original(shape, rope)
        factor = rope.get("factor") or shape.positions / original
        attention = rope.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
        shape_ = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        return 1.0 / (ext * base ** shape_), attention
    if kind == "llama3":
        inv = _base_inv_freq(base, dim, device)
        factor, low_f, high_f = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = _original(shape, rope)
        low_wavelen, high_wavelen = old / low_f, old / high_f
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low_f) / (high_f - low_f)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_type {kind!r} is not implemented")


def variants(shape: ModelShape) -> int:
    return 2 if shape.rope["rope_type"] == "longrope" else 1


def variant(shape: ModelShape, end: int) -> int:
    """Which table a forward whose last position is `end - 1` uses (LongRoPE: long past the
    original context, as transformers decides from the largest position id)."""
    rope = shape.rope
    return int(rope["rope_type"] == "longrope" and end > _original(shape, rope))


def rope_tables(shape: ModelShape, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (variants, seq_len, rotary_dim / 2), fp32, attention scaling applied."""
    t = torch.arange(shape.seq_len, device=device, dtype=torch.float32)
    cos, sin = [], []
    for v in range(variants(shape)):
        inv, scaling = inv_freq(shape, long=bool(v), device=device)
        freqs = torch.outer(t, inv)
        cos.append(freqs.cos() * scaling)
        sin.append(freqs.sin() * scaling)
    return torch.stack(cos), torch.stack(sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (T, r/2). Rotate the two halves of the first r dims (the
    halves convention of transformers' rotate_half), pass the rest through."""
    r = 2 * cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot = x if r == x.shape[-1] else x[..., :r]
    x1, x2 = rot.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)
