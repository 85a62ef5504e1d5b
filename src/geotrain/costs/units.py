"""Per-unit counts of the Llama model in geotrain.models.llama: parameters, FLOPs, saved bytes.

The model has only three kinds of unit -- the embedding (unit 0), `layers` identical blocks and
the final norm + head (unit layers+1) -- so everything here is computed once per kind and a stage
is just (has embedding, number of blocks, has head). That is what keeps stage sums O(1).

FLOPs follow the usual convention (Kaplan et al., PaLM appendix B, Megatron):
  * every matmul costs 2 * (its weight's parameters) * tokens in the forward pass;
  * attention scores and their application to V cost 2 * 2 * b * s^2 * hidden per block in the
    forward pass, counted WITHOUT the causal halving, as model-FLOPs-utilization figures are;
  * the backward pass costs twice the forward: for a matmul one product for the input gradient
    ("B", dgrad) and one for the weight gradient ("W", wgrad); attention has no weights, so its
    whole backward is input-gradient work;
  * the embedding is a gather (0 FLOPs); norms, RoPE, SiLU, softmax and residual adds are
    element-wise and left out (they are memory-bound; the GPU's efficiency factor absorbs them).

Saved-for-backward bytes (activations) are derived op by op in `activations.py`.

Mixed precision means the runtime's autocast: fp32 weights, matmuls computed in bf16/fp16.
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.costs.activations import (  # noqa: F401 -- re-exported: the unit counts in one place
    BLOCK,
    CHECKPOINTING,
    EMBEDDING,
    HEAD,
    KindActivations,
    attention_pairs,
    kind_activations,
)
from geotrain.models.shape import as_shape
from geotrain.spec.model import ModelSpec

KINDS = (EMBEDDING, BLOCK, HEAD)


def unit_kind(spec: ModelSpec, unit: int) -> str:
    if unit == 0:
        return EMBEDDING
    if 1 <= unit <= spec.layers:
        return BLOCK
    if unit == spec.layers + 1:
        return HEAD
    raise IndexError(f"unit {unit} out of range 0..{spec.layers + 1}")


def kind_params(spec: ModelSpec) -> dict[str, int]:
    """Parameters of one unit of each kind (what llama.py allocates: biases, q/k norms, every expert)."""
    h = spec.hidden
    return {
        EMBEDDING: spec.vocab * h,
        BLOCK: as_shape(spec).block_params(),
        HEAD: h + h * spec.vocab,
    }


def block_matmul_params(spec: ModelSpec) -> int:
    """Matmul parameters one token of a block computes with: attention's projections and the MLP's,
    of a mixture of experts the router, the k experts it picks and the shared one."""
    h = spec.hidden
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    attention = 2 * h * q + 2 * h * kv                                 # wq, wo; wk, wv
    if spec.experts:
        shared = 3 * h * spec.shared_expert_ffn + h if spec.shared_expert_ffn else 0
        return attention + h * spec.experts + 3 * h * spec.experts_per_token * spec.expert_ffn + shared
    return attention + 3 * h * spec.ffn                                # gate, up, down


def kind_matmul_params(spec: ModelSpec) -> dict[str, int]:
    """Parameters that enter a matmul (the 2 * params * tokens rule): no norms, no embedding."""
    return {EMBEDDING: 0, BLOCK: block_matmul_params(spec), HEAD: spec.hidden * spec.vocab}


def attention_forward_flops(spec: ModelSpec, micro_batch: int) -> float:
    """QK^T and (softmax)V of one block: 2 * 2 * b * (score pairs) * (heads * head_dim)."""
    return 4.0 * micro_batch * attention_pairs(spec) * spec.heads * spec.head_dim


@dataclass(frozen=True)
class KindFlops:
    """FLOPs of one unit for one micro-batch, split the way schedules need them."""

    forward: float
    backward_input: float     # dgrad (and all of attention's backward)
    backward_weight: float    # wgrad
    attention_forward: float  # the part of `forward` in attention's s^2 products (keep-matmul recomputes it)

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight


def kind_flops(spec: ModelSpec, micro_batch: int) -> dict[str, KindFlops]:
    tokens = micro_batch * spec.seq_len
    mm = kind_matmul_params(spec)
    out = {}
    for kind in KINDS:
        matmul = 2.0 * mm[kind] * tokens
        attn = attention_forward_flops(spec, micro_batch) if kind == BLOCK else 0.0
        out[kind] = KindFlops(forward=matmul + attn, backward_input=matmul + 2 * attn,
                              backward_weight=matmul, attention_forward=attn)
    return out


def recompute_share(checkpointing: str, f) -> float:
    """The fraction of a block's forward FLOPs its backward replays: all of it under full
    checkpointing; under a selective policy the expensive ops it does not keep -- attention's s^2
    products for keep-matmul, every matmul for keep-attention, none for selective (it keeps both)."""
    if checkpointing == "full":
        return 1.0
    if checkpointing == "keep-matmul":
        return f.attention_forward / f.forward
    if checkpointing == "keep-attention":
        return (f.forward - f.attention_forward) / f.forward
    return 0.0
