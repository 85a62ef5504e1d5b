"""Bytes a unit keeps alive between its forward and its backward, derived op by op from llama.py.

The count is what the runtime really holds, not a textbook formula: the plain model run as
`runtime/interpreter.py` runs it (fp32 weights, `torch.autocast` for bf16/fp16, blocks wrapped by
`runtime/activation_ckpt.py`, the loss in fp32), under each checkpointing policy and, for a split
backward, between B and W (`deferred_weight_bytes`). docs/MEMORY.md lists what each op keeps and
why; tests/test_cost_activations.py checks the count exactly against live storages.
Notation: T = micro_batch * seq_len tokens, h hidden, kv = kv_heads * head_dim, f ffn, V vocab,
p the compute dtype's bytes (4 fp32, 2 under autocast).
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.models.shape import as_shape
from geotrain.spec.model import ModelSpec

EMBEDDING, BLOCK, HEAD = "embedding", "block", "head"
# Every checkpointing mode: none; three selective policies (runtime/activation_ckpt.py: which op
# outputs a block keeps, the rest recomputed in backward), lightest first; full.
SELECTIVE = ("selective", "keep-matmul", "keep-attention")
CHECKPOINTING = ("none", "full", *SELECTIVE)
RESIDUAL_BYTES = 4  # the residual stream stays fp32: weights are fp32 and autocast leaves adds alone


@dataclass(frozen=True)
class KindActivations:
    """Bytes kept alive by one unit for one micro-batch.

    `replicated` is held whole on every tensor-parallel rank (norms, residual stream); `sharded` is
    split across tensor-parallel ranks (Megatron column/row-parallel attention and MLP and their
    weight copies, a vocab-parallel head)."""

    replicated: float
    sharded: float

    def per_gpu(self, tp: int) -> float:
        return self.replicated + self.sharded / tp

    @property
    def total(self) -> float:
        return self.replicated + self.sharded


def stage_input_bytes(spec: ModelSpec, micro_batch: int) -> int:
    """The fp32 stage input a non-first stage keeps per micro-batch (the received boundary tensor,
    converted back to fp32: the first block's norm saves it)."""
    return RESIDUAL_BYTES * micro_batch * spec.seq_len * spec.hidden


def _dims(spec) -> tuple[int, int, int]:
    """(q width heads * head_dim, kv width, the MLP rows one token computes: ffn, or its k experts'
    and the shared expert's)."""
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    f = spec.experts_per_token * spec.expert_ffn + spec.shared_expert_ffn if spec.experts else spec.ffn
    return q, kv, f


def mlp_rows(spec) -> int:
    """The MLP rows one token computes: ffn, or its k experts' and the shared expert's."""
    return _dims(spec)[2]


def rope_table_bytes(spec) -> int:
    """A block's fp32 cos and sin tables: seq_len x rotary_dim / 2 each, twice for LongRoPE."""
    shape = as_shape(spec)
    return 4 * shape.seq_len * shape.rotary_dim * (2 if shape.rope["rope_type"] == "longrope" else 1)


def attention_pairs(spec) -> int:
    """(query, key) score pairs attention computes per sequence, counted without the causal halving:
    s^2 -- also under a sliding window, since SDPA with a mask computes every score and masks them
    (the runtime has no windowed kernel), so the window saves no time here."""
    return spec.seq_len * spec.seq_len


def deferred_weight_bytes(spec: ModelSpec, micro_batch: int, dtype_bytes: int) -> dict[str, KindActivations]:
    """Per unit kind, what one micro-batch keeps beyond its forward's activations between a split
    backward's B (input gradient) and its W (weight gradient), when B ran through the unit.

    The first stage's B runs nothing (it has no input gradient to send; all of its backward runs
    at W), so its units keep nothing more -- `stage_memory` counts its held output gradient."""
    p, T, h, v = dtype_bytes, micro_batch * spec.seq_len, spec.hidden, spec.vocab
    q, kv, f = _dims(spec)
    k = spec.experts_per_token + bool(spec.shared_expert_ffn) if spec.experts else 1   # rows per token into down
    return {
        EMBEDDING: KindActivations(0, 0),
        # wq, wo (T x q, h); w_down (T x h per routed row); wk, wv (T x kv); gate, up (T x f); the two
        # norm-weight products (fp32)
        BLOCK: KindActivations(2 * 4 * T * h, p * T * (q + h + k * h + 2 * kv + 2 * f)),
        # the final norm's product, the head matmul's output gradient; minus the log-softmax and scalars
        HEAD: KindActivations(4 * T * h - 8, p * T * v - 4 * T * v),
    }


def _moe_bytes(spec, T: int, p: int) -> tuple[int, int]:
    """(replicated, sharded) bytes a MoE MLP keeps per micro-batch without checkpointing: the
    router's logits and fp32 softmax, the picks; each routed row's input (fp32, gathered), its
    gated MLP like a dense one's, its output and the fp32 copy the routing weight multiplies; the
    shared expert as a dense MLP. Per GPU under expert parallelism: its experts see k * T rows on
    average (balanced routing), as without it."""
    E, k, h, fe, fs = spec.experts, spec.experts_per_token, spec.hidden, spec.expert_ffn, spec.shared_expert_ffn
    rows = k * T
    autocast = p < 4
    router = p * T * E + 4 * T * E + 8 * rows + 3 * 4 * rows       # logits, softmax, picks; top-k weights
    routed = 4 * rows * h + (2 * p * rows * h if autocast else 0)  # gathered rows (+ a cast per gate/up)
    routed += 4 * p * rows * fe + p * rows * h + 4 * rows * h + 8 * rows   # gated MLP; outputs, fp32 copy; index
    shared = 4 * p * T * fs + 4 * T + 4 * T * h if fs else 0       # gated MLP, its sigmoid gate, the product
    return router, routed + shared


def kind_activations(spec: ModelSpec, micro_batch: int, dtype_bytes: int,
                     checkpointing: str) -> dict[str, KindActivations]:
    """Per unit kind, the bytes one micro-batch keeps alive (dtype_bytes 4 = fp32, no autocast).

    The families' switches add: Qwen3's q/k norms (their fp32 input and rsqrt, and the normed
    copy the weight multiplies), a sliding window's mask (SDPA keeps it in the compute dtype, s x s
    per block), a mixture of experts' router and routed rows (`_moe_bytes`) in place of the dense
    MLP; biases, Gemma's norms and GeLU keep what Llama's do."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"unknown checkpointing {checkpointing!r} (known: {', '.join(CHECKPOINTING)})")
    p, b, s, h, v = dtype_bytes, micro_batch, spec.seq_len, spec.hidden, spec.vocab
    autocast = p < 4
    T = b * s
    q, kv, f = _dims(spec)
    res = RESIDUAL_BYTES * T * h
    lse = 4 * b * spec.heads * s
    moe = bool(spec.experts)

    def norm(consumers: int) -> int:
        """One RMSNorm: normalized x and rsqrt, plus what its consumers keep of its output."""
        weighted = consumers * p * T * h if autocast else 4 * T * h
        return 4 * T * h + 4 * T + weighted

    matmul_params = 2 * h * q + 2 * h * kv + (3 * h * spec.ffn if not moe else
                                              h * spec.experts + 3 * h * (spec.experts * spec.expert_ffn
                                                                          + spec.shared_expert_ffn))
    weight_copies = p * matmul_params if autocast else 0
    rope_copies = 4 * p * s * (as_shape(spec).rotary_dim // 2) if autocast else 0
    qk_norm = 0
    if spec.qk_norm:
        heads = spec.heads + spec.kv_heads
        qk_norm = (4 + p if autocast else 8) * T * (q + kv) + 4 * T * heads
    window = p * s * s if spec.sliding_window and spec.sliding_window < s else 0
    mlp_consumers = (1 + 3 * bool(spec.shared_expert_ffn)) if moe else 2
    if moe:
        router, routed = _moe_bytes(spec, T, p)
        mlp_rep, mlp_shard = router, routed
    else:
        mlp_rep, mlp_shard = 0, 4 * p * T * f
    if checkpointing == "none":
        attn = p * T * q + 2 * p * T * kv + p * T * q + lse + p * T * q   # q, k, v; SDPA out + lse; wo input
        block = KindActivations(2 * res + norm(3) + norm(mlp_consumers) + mlp_rep + window,
                                attn + qk_norm + rope_copies + mlp_shard + weight_copies)
    elif checkpointing in SELECTIVE:
        matmul_outputs = p * T * q + 2 * p * T * h + 2 * p * T * kv + 2 * p * T * f  # wq; wo, w_down; wk, wv; gate, up
        sdpa = p * T * q + lse                                                     # SDPA's output and log-sum-exp
        kept = {"selective": matmul_outputs + sdpa, "keep-matmul": matmul_outputs, "keep-attention": sdpa}
        block = KindActivations(res + (window if checkpointing != "keep-matmul" else 0), kept[checkpointing])
    else:  # full: the block output; everything else is recomputed in backward
        block = KindActivations(res, 0)
    head_copy = p * v * h if autocast else 0
    return {
        EMBEDDING: KindActivations(res, 0),
        BLOCK: block,
        HEAD: KindActivations(norm(1) + 8, 4 * T * v + head_copy),
    }
