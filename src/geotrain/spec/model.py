"""Model spec: the validated shape of a decoder-only transformer (the families of `models.families`).

`ModelSpec` checks what a user wrote; `shape` hands the model package its own `ModelShape`,
which also holds the shape's arithmetic (head size, units, parameters) so it exists once."""

from __future__ import annotations

from dataclasses import fields
from functools import cached_property

from pydantic import Field, model_validator

from geotrain.models.families import family_problem
from geotrain.models.shape import ModelShape, shape_problem
from geotrain.spec.base import Strict, bounded_float, bounded_int

RopeValue = float | int | str | bool | list[float | int]


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
    rope_theta: bounded_float(1.0, 1e12) = 10000.0   # below 1: over a radian per token (tiny ones give NaN)
    # The family's switches (models.shape.ModelShape documents each); a family fixes some of them.
    family: str = "llama"
    head_size: int = Field(0, ge=0, le=2**14)
    max_positions: int = Field(0, ge=0, le=2**24)
    rope_scaling: dict[str, RopeValue] | None = None
    partial_rotary: float = Field(1.0, gt=0, le=1)
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = Field(0, ge=0, le=2**24)
    act: str = "silu"
    norm_offset: bool = False
    embed_scale: bool = False
    experts: int = Field(0, ge=0, le=2**14)
    experts_per_token: int = Field(0, ge=0, le=2**14)
    expert_ffn: int = Field(0, ge=0, le=2**22)
    shared_expert_ffn: int = Field(0, ge=0, le=2**22)
    norm_topk: bool = True
    router_aux_coef: float = Field(0.0, ge=0, le=100)
    # A Hugging Face directory (config.json + safetensors) the weights come from; the shape
    # fields above are then read from its config.json (spec.hf_config). None: deterministic init.
    hf: str | None = None
    # The HF checkpoint ties the output head to the embedding: trained as one matrix (a pipeline
    # keeps a copy on its first and last stage and sums their gradients: runtime.tied).
    tie_embeddings: bool = False
    # Tensors the model needs that the hf directory lacks start from the deterministic init
    # (said at load) instead of being an error.
    allow_missing: bool = False
    # The tokenizer's special tokens as the HF config.json says (kept by an export).
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @model_validator(mode="after")
    def _check_shape(self) -> ModelSpec:
        problem = shape_problem(self.shape) or family_problem(self.shape)
        if problem:
            raise ValueError(f"{problem[0]}: {problem[1]}")
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
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def num_units(self) -> int:
        """Pipeline-cuttable units: embedding, `layers` blocks, then final norm + head."""
        return self.shape.num_units

    def param_count(self) -> int:
        """Parameters the model stores: a tied embedding/head matrix counts once. (Compute is
        per matmul and so counts the head whether tied or not: `shape.param_count()`.)"""
        n = self.shape.param_count()
        return n - self.vocab * self.hidden if self.tie_embeddings else n


def tp_split_widths(model) -> list[tuple[str, int]]:
    """The widths tensor parallelism splits: heads, KV heads, the MLP's (each expert's and the
    shared expert's for a mixture of experts). A tp must divide each: `validate`, the planner and
    `simulate`/`train` (layout.tp_check) ask the same question here."""
    out = [("heads", model.heads), ("kv_heads", model.kv_heads)]
    if not getattr(model, "experts", 0):
        return out + [("ffn", model.ffn)]
    out.append(("expert_ffn", model.expert_ffn))
    return out + ([("shared_expert_ffn", model.shared_expert_ffn)] if model.shared_expert_ffn else [])
