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

Saved-for-backward bytes are counted tensor by tensor from what autograd really keeps for the
code in llama.py (checked in tests/test_cost_activations.py with saved-tensor hooks, exact to a
few bytes), with p = bytes of the training dtype and T = micro_batch * seq_len tokens:
  * RMSNorm (each of the two in a block, and the head's): the fp32 copy of its input (4*T*h; in
    fp32 that is the input itself), the fp32 1/rms (4*T), the normalized value cast back (p*T*h)
    and the weighted output that the next linear saves (p*T*h)  ->  (4 + 2p)*T*h + 4*T;
  * attention: q and k after RoPE (p*T*h, p*T*kv), v (p*T*kv), the SDPA output (p*T*h) and its
    fp32 log-sum-exp (4*b*heads*s), the re-laid-out output that wo saves (p*T*h) -- no s^2 term,
    the fused SDPA kernels never store the attention matrix;
  * SwiGLU: gate output, silu(gate), up output and their product (4 * p*T*ffn);
  * embedding: the int64 token ids (8*T); head: the norm as above, the log-softmax of the logits
    that cross-entropy keeps (p*T*vocab) and the int64 targets (8*T).
Checkpointing applies to blocks only (as Megatron does): "full" keeps a block's input (p*T*h)
and recomputes its forward during backward; "selective" recomputes only the core attention
(SDPA), so it drops the SDPA output and log-sum-exp and recomputes 4*b*s^2*h FLOPs.

Mixed precision here means the training dtype is the compute dtype of weights and activations
(FSDP MixedPrecisionPolicy(param_dtype=bf16) style), with fp32 master weights in the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.config.model import ModelSpec

EMBEDDING, BLOCK, HEAD = "embedding", "block", "head"
KINDS = (EMBEDDING, BLOCK, HEAD)
CHECKPOINTING = ("none", "full", "selective")


def unit_kind(spec: ModelSpec, unit: int) -> str:
    if unit == 0:
        return EMBEDDING
    if 1 <= unit <= spec.layers:
        return BLOCK
    if unit == spec.layers + 1:
        return HEAD
    raise IndexError(f"unit {unit} out of range 0..{spec.layers + 1}")


def kind_params(spec: ModelSpec) -> dict[str, int]:
    """Parameters of one unit of each kind (what llama.py allocates)."""
    h = spec.hidden
    return {
        EMBEDDING: spec.vocab * h,
        BLOCK: block_matmul_params(spec) + 2 * h,
        HEAD: h + h * spec.vocab,
    }


def block_matmul_params(spec: ModelSpec) -> int:
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    return 2 * h * h + 2 * h * kv + 3 * h * spec.ffn  # wq, wo; wk, wv; gate, up, down


def kind_matmul_params(spec: ModelSpec) -> dict[str, int]:
    """Parameters that enter a matmul (the 2 * params * tokens rule): no norms, no embedding."""
    return {EMBEDDING: 0, BLOCK: block_matmul_params(spec), HEAD: spec.hidden * spec.vocab}


def attention_forward_flops(spec: ModelSpec, micro_batch: int) -> float:
    """QK^T and (softmax)V of one block: 2 * 2 * b * s^2 * (heads * head_dim)."""
    return 4.0 * micro_batch * spec.seq_len * spec.seq_len * spec.hidden


@dataclass(frozen=True)
class KindFlops:
    """FLOPs of one unit for one micro-batch, split the way schedules need them."""

    forward: float
    backward_input: float     # dgrad (and all of attention's backward)
    backward_weight: float    # wgrad
    attention_forward: float  # the part of `forward` that selective checkpointing recomputes

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


@dataclass(frozen=True)
class KindActivations:
    """Bytes saved for backward by one unit for one micro-batch.

    `replicated` is held whole on every tensor-parallel rank (norms, unit inputs); `sharded` is
    split across tensor-parallel ranks (Megatron column/row-parallel attention and MLP, a
    vocab-parallel head)."""

    replicated: float
    sharded: float

    def per_gpu(self, tp: int) -> float:
        return self.replicated + self.sharded / tp


def kind_activations(spec: ModelSpec, micro_batch: int, dtype_bytes: int,
                     checkpointing: str) -> dict[str, KindActivations]:
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"unknown checkpointing {checkpointing!r} (known: {', '.join(CHECKPOINTING)})")
    p, b, s, h = dtype_bytes, micro_batch, spec.seq_len, spec.hidden
    T = b * s
    kv = spec.kv_heads * spec.head_dim
    norm = (4 + 2 * p) * T * h + 4 * T
    sdpa_out = p * T * h + 4 * b * spec.heads * s  # output + fp32 log-sum-exp
    attn_inputs = p * T * h + 2 * p * T * kv       # q, k after RoPE; v
    wo_input = p * T * h
    mlp = 4 * p * T * spec.ffn
    if checkpointing == "none":
        block = KindActivations(2 * norm, attn_inputs + sdpa_out + wo_input + mlp)
    elif checkpointing == "selective":
        block = KindActivations(2 * norm, attn_inputs + wo_input + mlp)
    else:  # full: only the block's input survives the forward
        block = KindActivations(p * T * h, 0)
    return {
        EMBEDDING: KindActivations(8 * T, 0),
        BLOCK: block,
        HEAD: KindActivations(norm + 8 * T, p * T * spec.vocab),
    }
