"""Prefill and decode with a KV cache on the plain Llama model, for the inference service.

Prefill may come in chunks (one bubble may not hold a whole prompt): a chunk's queries sit at
positions [p, p + n) and attend to every cached key at or before their own position. The
model file stays training-only; this module reads its weights, it does not change them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from geotrain.models.llama import Attention, Block, Embedding, Head, UnitStack


@dataclass
class KVCache:
    """Per block: keys and values of every token seen, shape (1, kv_heads, T, head_dim)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def to_bytes(self) -> tuple[bytes, list[int], str]:
        """Raw little-endian bytes of all K then all V tensors (no pickling), their shape, dtype."""
        # (2, L, 1, kvH, T, D), in host memory (a CUDA rank's cache lives on its GPU)
        flat = torch.stack([torch.stack(self.keys), torch.stack(self.values)]).cpu().contiguous()
        raw = flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat  # numpy has no bfloat16
        return raw.numpy().tobytes(), list(flat.shape), str(flat.dtype).removeprefix("torch.")

    @classmethod
    def from_bytes(cls, data: bytes, shape: list[int], dtype: str) -> KVCache:
        dt = getattr(torch, dtype)
        if dt == torch.bfloat16:
            flat = torch.frombuffer(bytearray(data), dtype=torch.int16).view(torch.bfloat16)
        else:
            flat = torch.frombuffer(bytearray(data), dtype=dt)
        flat = flat.reshape(shape)
        return cls(keys=list(flat[0].unbind(0)), values=list(flat[1].unbind(0)))


def _attend(block: Block, x: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
    """The block's attention for queries at [p, p + n) after the p cached positions, caching their
    keys and values (the model's own projections, norms, RoPE tables and window)."""
    attn: Attention = block.attn
    n = x.shape[1]
    p = cache.keys[layer].shape[2] if layer < len(cache.keys) else 0
    cos, sin = block.rope(p + n)
    q, k, v = attn.qkv(x, cos[p:p + n], sin[p:p + n])
    if layer < len(cache.keys):
        k = torch.cat([cache.keys[layer], k], dim=2)
        v = torch.cat([cache.values[layer], v], dim=2)
        cache.keys[layer], cache.values[layer] = k, v
    else:
        cache.keys.append(k)
        cache.values.append(v)
    return attn.attend(q, k, v, q_start=p)


@torch.no_grad()
def forward_with_cache(model: UnitStack, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run `tokens` (1, n) after the cached context; returns logits of the last position."""
    if not (model.has_embedding and model.has_head):
        raise ValueError("inference needs the whole model (embedding to head)")
    if cache.length + tokens.shape[1] > model.spec.seq_len:
        raise ValueError(f"context of {cache.length + tokens.shape[1]} tokens exceeds seq_len {model.spec.seq_len}")
    x, layer = tokens.to(next(model.parameters()).device), 0    # a CUDA rank's model lives on its GPU
    for unit in model.units.values():
        if isinstance(unit, Embedding):
            x = unit(x)
        elif isinstance(unit, Block):
            x = x + _attend(unit, unit.attn_norm(x), cache, layer)
            x = x + unit.ffn(unit.ffn_norm(x))
            layer += 1
        elif isinstance(unit, Head):
            x = unit(x[:, -1:, :])
    return x[0, -1]


def prefill(model: UnitStack, tokens: list[int], chunk: int | None = None) -> tuple[int, KVCache]:
    """Prefill a prompt (optionally in chunks); returns the first generated token (greedy)."""
    cache = KVCache()
    t = torch.tensor([tokens], dtype=torch.long)
    step = chunk or len(tokens)
    logits = None
    for i in range(0, len(tokens), step):
        logits = forward_with_cache(model, t[:, i:i + step], cache)
    return int(torch.argmax(logits)), cache


def greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


class Sampler:
    """OpenAI-style sampling of one token from logits: temperature 0 is greedy (argmax);
    otherwise softmax(logits / temperature), cut to the smallest set of tokens whose probability
    reaches top_p, drawn from a generator seeded by `seed` (the same seed, the same tokens)."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None):
        self.temperature, self.top_p = temperature, top_p
        self.gen = torch.Generator()
        self.gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))

    def __call__(self, logits: torch.Tensor) -> int:
        if self.temperature <= 0:
            return greedy(logits)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < self.top_p   # always keeps the most likely
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.gen))


def last_logits(model: UnitStack, cache: KVCache, last_token: int) -> torch.Tensor:
    """The logits a prefill ended with, from its KV cache: the last prompt position is dropped
    from the cache and run again (one decode step), leaving the cache as it was."""
    n = cache.length - 1
    cache.keys = [k[:, :, :n] for k in cache.keys]
    cache.values = [v[:, :, :n] for v in cache.values]
    return forward_with_cache(model, torch.tensor([[last_token]]), cache)


def decode(model: UnitStack, first: int, cache: KVCache, max_new_tokens: int, pick=greedy):
    """Decode after a prefill (greedy unless `pick` samples): yields the following tokens one at
    a time, and stops where the context is full."""
    tok = first
    for _ in range(max_new_tokens):
        if cache.length >= model.spec.seq_len:
            return
        tok = pick(forward_with_cache(model, torch.tensor([[tok]]), cache))
        yield tok
