"""The Hugging Face families the one decoder computes: which switches each fixes or lets a config
set, how its tensors are named (Phi-3's fused projections, the experts' per-expert tensors), and
the config.json an export writes. Torch-free: the spec layer reads it.

A geotrain parameter comes from one HF tensor (`Source(names=(n,))`), a block of rows of a fused
one (`rows`: Phi-3's qkv_proj and gate_up_proj, split on load and concatenated again on export),
or one tensor per expert stacked along a new first dim (the experts of a MoE block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from geotrain.models.shape import ModelShape

EMBED, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)   # older checkpoints store RoPE tables; transformers ignores them

ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
}
MOE = {"mixtral", "qwen3_moe", "qwen2_moe"}
# Switches with the value each family's modeling code hard-wires.
_DEFAULTS = {"head_size": 0, "rope_scaling": (), "partial_rotary": 1.0, "qkv_bias": False, "out_bias": False,
             "mlp_bias": False, "qk_norm": False, "sliding_window": 0, "act": "silu", "norm_offset": False,
             "embed_scale": False, "experts": 0, "experts_per_token": 0, "expert_ffn": 0,
             "shared_expert_ffn": 0, "norm_topk": True, "router_aux_coef": 0.0}
_MOE_FREE = {"experts", "experts_per_token", "expert_ffn", "router_aux_coef"}
_FIXED = {"qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True}, "qwen3_moe": {"qk_norm": True},
          "qwen2_moe": {"qkv_bias": True},
          "gemma": {"act": "gelu_tanh", "norm_offset": True, "embed_scale": True}}
_FREE = {
    "llama": {"head_size", "rope_scaling", "qkv_bias", "out_bias", "mlp_bias"},
    "mistral": {"head_size", "rope_scaling", "sliding_window"},
    "qwen2": {"rope_scaling", "sliding_window"},
    "qwen3": {"head_size", "rope_scaling", "sliding_window", "qkv_bias", "out_bias"},
    "gemma": {"head_size", "rope_scaling", "qkv_bias", "out_bias"},
    "phi3": {"rope_scaling", "partial_rotary", "sliding_window"},
    "mixtral": {"head_size", "rope_scaling", "sliding_window", *_MOE_FREE},
    "qwen3_moe": {"head_size", "rope_scaling", "sliding_window", "qkv_bias", "out_bias", "norm_topk", *_MOE_FREE},
    "qwen2_moe": {"rope_scaling", "sliding_window", "norm_topk", "shared_expert_ffn", *_MOE_FREE},
}
_ONE_ATTENTION_BIAS = {"llama", "qwen3", "gemma", "qwen3_moe"}     # attention_bias: q, k, v and o alike


def family_problem(s: ModelShape) -> tuple[str, str] | None:
    """(field, reason) when the switches are not ones `s.family`'s own code can have."""
    if s.family not in ARCHITECTURES:
        return "family", f"{s.family!r} is not one of {', '.join(ARCHITECTURES)}"
    fixed, free = _FIXED.get(s.family, {}), _FREE[s.family]
    for key, default in _DEFAULTS.items():
        value = getattr(s, key)
        want = fixed.get(key, default)
        if key == "head_size" and value == s.hidden // s.heads and s.hidden % s.heads == 0:
            continue
        if key not in free and value != want:
            return key, f"a {s.family} model has {key} = {want!r} (got {value!r})"
    if s.family in _ONE_ATTENTION_BIAS and s.qkv_bias != s.out_bias:
        return "out_bias", f"a {s.family} model biases q, k, v and o alike (attention_bias)"
    if s.family == "mixtral" and s.moe and s.ffn != s.expert_ffn:
        return "expert_ffn", f"a mixtral model's experts are intermediate_size = ffn = {s.ffn} wide"
    if (s.family in MOE) != s.moe:
        return "experts", (f"a {s.family} model has experts" if s.family in MOE else
                           f"a {s.family} model has no experts (families with experts: {', '.join(sorted(MOE))})")
    return None


@dataclass(frozen=True)
class Source:
    names: tuple[str, ...]                  # one tensor, or one per expert (stacked along dim 0)
    rows: tuple[int, int] | None = None     # (first row, rows) of a fused tensor


def _block(s: ModelShape, i: int) -> dict[str, Source]:
    p = f"model.layers.{i}."
    out = {"attn_norm.weight": Source((p + "input_layernorm.weight",)),
           "ffn_norm.weight": Source((p + "post_attention_layernorm.weight",)),
           "attn.wo.weight": Source((p + "self_attn.o_proj.weight",))}
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    if s.family == "phi3":
        fused = p + "self_attn.qkv_proj.weight"
        out |= {"attn.wq.weight": Source((fused,), (0, q)), "attn.wk.weight": Source((fused,), (q, kv)),
                "attn.wv.weight": Source((fused,), (q + kv, kv))}
    else:
        for x in "qkv":
            out[f"attn.w{x}.weight"] = Source((f"{p}self_attn.{x}_proj.weight",))
            if s.qkv_bias:
                out[f"attn.w{x}.bias"] = Source((f"{p}self_attn.{x}_proj.bias",))
    if s.out_bias:
        out["attn.wo.bias"] = Source((p + "self_attn.o_proj.bias",))
    if s.qk_norm:
        out |= {"attn.q_norm.weight": Source((p + "self_attn.q_norm.weight",)),
                "attn.k_norm.weight": Source((p + "self_attn.k_norm.weight",))}
    if s.moe:
        return out | _moe(s, p)
    if s.family == "phi3":
        fused = p + "mlp.gate_up_proj.weight"
        return out | {"ffn.w_gate.weight": Source((fused,), (0, s.ffn)),
                      "ffn.w_up.weight": Source((fused,), (s.ffn, s.ffn)),
                      "ffn.w_down.weight": Source((p + "mlp.down_proj.weight",))}
    kinds = ("weight", "bias") if s.mlp_bias else ("weight",)
    return out | {f"ffn.w_{x}.{k}": Source((f"{p}mlp.{x}_proj.{k}",)) for x in ("gate", "up", "down") for k in kinds}


def _moe(s: ModelShape, p: str) -> dict[str, Source]:
    E = range(s.experts)
    if s.family == "mixtral":
        m = p + "block_sparse_moe."
        names = {"gate": "w1", "up": "w3", "down": "w2"}
        out = {"ffn.router.weight": Source((m + "gate.weight",))}
        return out | {f"ffn.experts.w_{x}": Source(tuple(f"{m}experts.{e}.{w}.weight" for e in E))
                      for x, w in names.items()}
    m = p + "mlp."
    out = {"ffn.router.weight": Source((m + "gate.weight",))}
    out |= {f"ffn.experts.w_{x}": Source(tuple(f"{m}experts.{e}.{x}_proj.weight" for e in E))
            for x in ("gate", "up", "down")}
    if s.shared_expert_ffn:
        out |= {f"ffn.shared.w_{x}.weight": Source((f"{m}shared_expert.{x}_proj.weight",))
                for x in ("gate", "up", "down")}
        out["ffn.shared_gate.weight"] = Source((m + "shared_expert_gate.weight",))
    return out


def hf_sources(s: ModelShape, unit: int, tied: bool = False) -> dict[str, Source]:
    """geotrain parameter name inside unit `unit` (e.g. "attn.wq.weight") -> where its values are."""
    if unit == 0:
        return {"tok.weight": Source((EMBED,))}
    if unit == s.layers + 1:
        return {"norm.weight": Source((NORM,)), "out.weight": Source((EMBED if tied else HEAD,))}
    if 1 <= unit <= s.layers:
        return _block(s, unit - 1)
    raise IndexError(f"unit {unit} out of range 0..{s.layers + 1}")


def hf_tensor_names(s: ModelShape, tied: bool = False) -> set[str]:
    """Every HF tensor name the whole model reads."""
    return {n for u in range(s.num_units) for src in hf_sources(s, u, tied).values() for n in src.names}


def _rope_parameters(s: ModelShape) -> dict[str, Any]:
    rope = {k: list(v) if isinstance(v, tuple) else v for k, v in s.rope.items()}
    rope["rope_theta"] = s.rope_theta
    if s.family == "phi3":
        rope["partial_rotary_factor"] = s.partial_rotary
    return rope


def hf_config(spec, dtype: str = "float32") -> dict[str, Any]:
    """The config.json of an export: the family's own keys, tied exactly when the model trained
    tied, the tokenizer's special ids kept."""
    s: ModelShape = spec.shape if hasattr(spec, "shape") else spec
    f = s.family
    doc: dict[str, Any] = {
        "architectures": [ARCHITECTURES[f]], "model_type": f,
        "vocab_size": s.vocab, "hidden_size": s.hidden, "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "hidden_act": "gelu_pytorch_tanh" if s.act == "gelu_tanh" else "silu",
        "max_position_embeddings": s.positions, "rms_norm_eps": s.norm_eps,
        "rope_parameters": _rope_parameters(s), "attention_dropout": 0.0,
        "tie_word_embeddings": bool(getattr(spec, "tie_embeddings", False)), "dtype": dtype,
        "initializer_range": 0.02,
        "bos_token_id": getattr(spec, "bos_token_id", None), "eos_token_id": getattr(spec, "eos_token_id", None),
        "pad_token_id": getattr(spec, "pad_token_id", None),
    }
    if "head_size" in _FREE[f]:
        doc["head_dim"] = s.head_dim
    if f in _ONE_ATTENTION_BIAS:
        doc["attention_bias"] = s.qkv_bias
    if f == "llama":
        doc["mlp_bias"] = s.mlp_bias
    if f in ("mistral", "mixtral", "phi3"):
        doc["sliding_window"] = s.sliding_window or None
    if f in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        doc |= {"use_sliding_window": bool(s.sliding_window), "sliding_window": s.sliding_window or None}
        if f != "qwen3_moe":
            doc["max_window_layers"] = 0 if s.sliding_window else s.layers
    if f == "phi3":
        doc |= {"resid_pdrop": 0.0, "embd_pdrop": 0.0}
        if "original_max_position_embeddings" in s.rope:
            doc["original_max_position_embeddings"] = s.rope["original_max_position_embeddings"]
    if s.moe:
        doc |= {"num_experts_per_tok": s.experts_per_token, "router_aux_loss_coef": s.router_aux_coef,
                "output_router_logits": False}
        if f == "mixtral":
            doc |= {"num_local_experts": s.experts, "router_jitter_noise": 0.0}
        else:
            doc |= {"num_experts": s.experts, "moe_intermediate_size": s.expert_ffn, "norm_topk_prob": s.norm_topk,
                    "decoder_sparse_step": 1, "mlp_only_layers": []}
        if f == "qwen2_moe":
            doc["shared_expert_intermediate_size"] = s.shared_expert_ffn
    return doc
