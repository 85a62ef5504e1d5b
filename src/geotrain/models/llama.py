"""The decoder (RMSNorm, RoPE, gated MLP, grouped-query attention) in plain PyTorch, with switches.

One model covers Llama 2/3.x, Mistral, Qwen2/2.5/3, SmolLM2, Gemma, Phi-3 and the mixture-of-experts
families: each switch of `ModelShape` (biases, q/k norms, sliding-window attention, explicit head
size, scaled RoPE, GeLU, Gemma's (1 + w) norms and scaled embeddings, routed experts) is the
difference transformers' own classes make, computed the same way.

The model is a flat sequence of *units* -- embedding, `layers` blocks, final norm + head -- so a
pipeline stage is just a contiguous slice of units (`build_units`), and the full model is the
slice covering all of them. Nothing here knows about processes, devices or sharding, nor about
specs: `spec` is a `ModelShape` (or anything with its fields, such as a validated config `ModelSpec`).
The residual stream is fp32 whatever the weights' dtype; each projection reads its input in its
weight's dtype (under autocast, autocast casts), so `.to(torch.bfloat16)` runs.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from geotrain.models.moe import MoE
from geotrain.models.rope import apply_rope, rope_tables, variant
from geotrain.models.shape import ModelShape, as_shape

__all__ = ["apply_rope", "rope_tables"]


def _in(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x in the layer's weight dtype (a bf16 model's projections read bf16); autocast casts itself."""
    w = layer.weight
    if x.dtype == w.dtype or torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(w.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:                                   # Gemma: (x * (1 + w)) in fp32, then cast
            return (out * (1.0 + self.weight.float())).type_as(x)
        return out.type_as(x) * self.weight


def attention_mask(q_start: int, n: int, total: int, window: int, device=None) -> torch.Tensor | None:
    """Which keys [0, total) queries at [q_start, q_start + n) see: those at or before their own
    position and, with a sliding window, fewer than `window` positions back. None: plain causal
    over a square (SDPA's is_causal)."""
    if q_start == 0 and n == total and not (window and total > window):
        return None
    q = torch.arange(q_start, q_start + n, device=device).unsqueeze(1)
    k = torch.arange(total, device=device).unsqueeze(0)
    mask = k <= q
    return mask & (q - k < window) if window else mask


class Attention(nn.Module):
    def __init__(self, spec: ModelShape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.window = spec.sliding_window
        q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        self.wq = nn.Linear(spec.hidden, q, bias=spec.qkv_bias)
        self.wk = nn.Linear(spec.hidden, kv, bias=spec.qkv_bias)
        self.wv = nn.Linear(spec.hidden, kv, bias=spec.qkv_bias)
        self.wo = nn.Linear(q, spec.hidden, bias=spec.out_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(spec.head_dim, spec.norm_eps, spec.norm_offset)
        else:
            self.q_norm = self.k_norm = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k, v as (B, heads, T, head_dim), q and k normed (Qwen3) and rotated by cos/sin (T rows)."""
        B, T, _ = x.shape
        q = self.wq(_in(x, self.wq)).view(B, T, self.heads, self.head_dim)
        k = self.wk(_in(x, self.wk)).view(B, T, self.kv_heads, self.head_dim)
        v = self.wv(_in(x, self.wv)).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int = 0) -> torch.Tensor:
        """The output projection of attention from queries at [q_start, ...) to every key given."""
        B, _, n, _ = q.shape
        mask = attention_mask(q_start, n, k.shape[2], self.window, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=self.kv_heads != self.heads)
        out = out.transpose(1, 2).reshape(B, n, -1)
        return self.wo(_in(out, self.wo))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        q, k, v = self.qkv(x, cos[:T], sin[:T])
        return self.attend(q, k, v)


def activation(name: str):
    return F.silu if name == "silu" else (lambda x: F.gelu(x, approximate="tanh"))


class FeedForward(nn.Module):
    def __init__(self, spec: ModelShape, ffn: int | None = None, bias: bool | None = None):
        super().__init__()
        ffn = spec.ffn if ffn is None else ffn
        bias = spec.mlp_bias if bias is None else bias
        self.w_gate = nn.Linear(spec.hidden, ffn, bias=bias)
        self.w_up = nn.Linear(spec.hidden, ffn, bias=bias)
        self.w_down = nn.Linear(ffn, spec.hidden, bias=bias)
        self.act = activation(spec.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _in(x, self.w_gate)
        h = self.act(self.w_gate(x)) * self.w_up(x)
        return self.w_down(_in(h, self.w_down))


class Block(nn.Module):
    def __init__(self, spec: ModelShape):
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden, spec.norm_eps, spec.norm_offset)
        self.attn = Attention(spec)
        self.ffn_norm = RMSNorm(spec.hidden, spec.norm_eps, spec.norm_offset)
        self.ffn = MoE(spec, FeedForward, activation(spec.act)) if spec.moe else FeedForward(spec)
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

    def rope(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables (seq_len rows) a forward reaching position `end - 1` uses."""
        v = variant(self.spec, end)
        return self.rope_cos[v], self.rope_sin[v]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), *self.rope(x.shape[1]))
        return x + self.ffn(self.ffn_norm(x))


class Embedding(nn.Module):
    """Token embedding. Its output -- the residual stream -- is fp32 whatever dtype the weights are
    held in (16-bit weights give a 16-bit lookup, cast up here; fp32 weights: no copy), so the
    additions of every block stay in fp32. Gemma scales it by sqrt(hidden), in the weights' dtype."""

    def __init__(self, spec: ModelShape):
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.hidden)
        self.scale = spec.hidden ** 0.5 if spec.embed_scale else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=torch.float32).to(x.dtype)
        return x.float()


class Head(nn.Module):
    def __init__(self, spec: ModelShape):
        super().__init__()
        self.norm = RMSNorm(spec.hidden, spec.norm_eps, spec.norm_offset)
        self.out = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(_in(self.norm(x), self.out))


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
    for a constant (RMSNorm weights: ones, or zeros under (1 + w); biases: zeros). Output
    projections get std / sqrt(2 * layers)."""
    if name.endswith(("norm.weight", ".bias")):
        return None
    return 0.02 / math.sqrt(2 * spec.layers) if name.endswith(("wo.weight", "w_down.weight", "w_down")) else 0.02


def init_constant(spec: ModelShape, name: str) -> float:
    return 1.0 if name.endswith("norm.weight") and not spec.norm_offset else 0.0


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
        return out.fill_(init_constant(spec, name))
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
        spec = as_shape(spec)
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
