"""The shape of a Llama-style decoder: what the model needs to be built, and nothing else.

Owned by `models` (the model is built from it) and built by `config` from validated TOML
(`ModelSpec.shape`), so the torch model never sees a spec and the spec never sees torch.
The per-shape arithmetic (head size, cuttable units, parameter count) lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_units(self) -> int:
        """Pipeline-cuttable units: embedding, `layers` blocks, then final norm + head."""
        return self.layers + 2

    def param_count(self) -> int:
        h, f, v = self.hidden, self.ffn, self.vocab
        kv = self.kv_heads * self.head_dim
        block = h * h * 2 + 2 * h * kv + 3 * h * f + 2 * h  # q,o + k,v + gate,up,down + 2 norms
        return v * h + self.layers * block + h + h * v  # embedding + blocks + final norm + head
