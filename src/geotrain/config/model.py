"""Model spec: the shape of a decoder-only (Llama-style) transformer."""

from __future__ import annotations

from pydantic import Field, PositiveInt, model_validator

from geotrain.config.base import Strict


class ModelSpec(Strict):
    name: str = "custom"
    layers: PositiveInt
    hidden: PositiveInt
    heads: PositiveInt
    kv_heads: PositiveInt
    ffn: PositiveInt
    vocab: PositiveInt
    seq_len: PositiveInt
    norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    # A Hugging Face Llama directory (config.json + safetensors) the weights come from; the shape
    # fields above are then read from its config.json (config.hf). None: deterministic init.
    hf: str | None = None
    # The HF checkpoint ties the output head to the embedding. geotrain loads the tied matrix
    # into both (a pipeline keeps them on different stages) and trains them as two matrices.
    tie_embeddings: bool = False

    @model_validator(mode="after")
    def _check_shape(self) -> ModelSpec:
        if self.hidden % self.heads:
            raise ValueError(f"hidden: {self.hidden} is not divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError("hidden: head dimension must be even for rotary embeddings")
        return self

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
