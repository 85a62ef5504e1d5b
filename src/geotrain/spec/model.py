"""Model spec: the validated shape of a decoder-only (Llama-style) transformer.

`ModelSpec` checks what a user wrote; `shape` hands the model package its own `ModelShape`,
which also holds the shape's arithmetic (head size, units, parameters) so it exists once."""

from __future__ import annotations

from dataclasses import fields
from functools import cached_property

from pydantic import Field, model_validator

from geotrain.models.shape import ModelShape
from geotrain.spec.base import Strict, bounded_int


class ModelSpec(Strict):
    name: str = "custom"
    layers: bounded_int(1, 10_000)
    hidden: bounded_int(1, 2**20)
    heads: bounded_int(1, 2**14)
    kv_heads: bounded_int(1, 2**14)
    ffn: bounded_int(1, 2**22)
    vocab: bounded_int(1, 2**24)
    seq_len: bounded_int(1, 2**24)
    norm_eps: float = Field(1e-5, gt=0, le=1)
    rope_theta: float = Field(10000.0, gt=0, le=1e12)
    # A Hugging Face Llama directory (config.json + safetensors) the weights come from; the shape
    # fields above are then read from its config.json (spec.hf_config). None: deterministic init.
    hf: str | None = None
    # The HF checkpoint ties the output head to the embedding: trained as one matrix (a pipeline
    # keeps a copy on its first and last stage and sums their gradients: runtime.tied).
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

    @cached_property
    def shape(self) -> ModelShape:
        """This shape as the model package's own type (built once: the spec is frozen). Where the
        weights come from (`hf`, `tie_embeddings`) is not part of the shape."""
        return ModelShape(**{f.name: getattr(self, f.name) for f in fields(ModelShape)})

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def num_units(self) -> int:
        """Pipeline-cuttable units: embedding, `layers` blocks, then final norm + head."""
        return self.shape.num_units

    def param_count(self) -> int:
        """Parameters the model stores: a tied embedding/head matrix counts once. (Compute is
        per matmul and so counts the head whether tied or not: `shape.param_count()`.)"""
        n = self.shape.param_count()
        return n - self.vocab * self.hidden if self.tie_embeddings else n
