"""A Hugging Face `config.json` read into geotrain's model-spec fields, for every family the
decoder computes (`models.families`: Llama 2/3.x and SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma,
Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE).

Every key is accounted for: one that changes the math is read into a switch, or refused with one
line naming it when the decoder does not compute it (a dropout, a sliding window on some layers
only, router jitter, interleaved RoPE); one that does not (bookkeeping, generation defaults, init
ranges, SmolLM2's `is_llama_config`) is accepted. Loading weights into a model that computes
something else would train or serve garbage without an error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from geotrain.models.families import ARCHITECTURES, MOE

# Fields that change nothing geotrain computes (bookkeeping, generation defaults, init, remote code).
_IGNORED = {
    "transformers_version", "architectures", "output_hidden_states", "output_attentions", "return_dict",
    "dtype", "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "initializer_range", "use_cache", "pretraining_tp", "_name_or_path", "model_type",
    "tokenizer_class", "is_llama_config", "auto_map", "output_router_logits", "max_window_layers",
    "use_sliding_window", "layer_types", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id", "sliding_window", "rope_theta", "rope_parameters", "rope_scaling", "head_dim",
    "hidden_act", "hidden_activation", "original_max_position_embeddings", "partial_rotary_factor",
}
_SHAPE = {"hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "num_hidden_layers",
          "vocab_size", "max_position_embeddings", "rms_norm_eps"}
_ZERO = ("attention_dropout", "resid_pdrop", "embd_pdrop", "router_jitter_noise")  # must be 0 (or absent)
_MOE_KEYS = {"num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
             "router_aux_loss_coef", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
             "shared_expert_intermediate_size"}


class HFConfigError(ValueError):
    """`field: reason` about a config.json."""


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _num(doc: dict[str, Any], key: str, default: Any = ..., kind: type = int, least: float = 1) -> Any:
    """doc[key] as a finite number of `kind` (an int where a float is asked is fine), >= least."""
    if key not in doc or (doc[key] is None and default is not ...):
        if default is ...:
            raise HFConfigError(f"{key}: required field is missing")
        return default
    value = doc[key]
    ok = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if not ok or isinstance(value, bool) or not -1e300 < value < 1e300 or value < least:   # (not NaN, inf, 10**400)
        what = "an integer" if kind is int else "a number"
        raise HFConfigError(f"{key}: must be {what} >= {least:g} (got {value!r:.40})")
    return kind(value)


def _flag(doc: dict[str, Any], key: str, default: bool = False) -> bool:
    value = doc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HFConfigError(f"{key}: must be true or false (got {value!r})")
    return value


def _rope(doc: dict[str, Any], family: str, positions: int) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling or None, partial rotary factor)."""
    rope = doc.get("rope_parameters") or doc.get("rope_scaling")
    field = "rope_parameters" if doc.get("rope_parameters") else "rope_scaling"
    if rope is None:
        rope = {}
    if not isinstance(rope, dict):
        raise HFConfigError(f"{field}: must be a table (got {rope!r})")
    rope = {k: v for k, v in rope.items() if v is not None}
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    rope.pop("type", None)
    top = _num(doc, "rope_theta", None, float, 1e-12)
    theta = _num({"rope_theta": rope.pop("rope_theta", top)}, "rope_theta", 10000.0, float, 1e-12)
    if top is not None and top != theta:
        raise HFConfigError(f"rope_theta: {top:g} here, {theta:g} in {field}")
    partial = rope.pop("partial_rotary_factor", doc.get("partial_rotary_factor", 1.0))
    partial = _num({"partial_rotary_factor": partial}, "partial_rotary_factor", 1.0, float, 1e-12)
    if partial != 1.0 and family != "phi3":
        raise HFConfigError(f"partial_rotary_factor: a {family} model rotates whole heads (got {partial})")
    if not isinstance(kind, str):
        raise HFConfigError(f"{field}.rope_type: must be a string (got {kind!r})")
    if kind == "default":
        if rope:
            raise HFConfigError(f"{field}.{sorted(rope)[0]}: not a parameter of rope_type 'default'")
        return theta, None, partial
    if kind in ("llama3", "yarn", "longrope"):
        original = doc.get("original_max_position_embeddings") if family == "phi3" else None
        rope.setdefault("original_max_position_embeddings", original or positions)
    if kind == "yarn" and "factor" not in rope and isinstance(rope["original_max_position_embeddings"], int):
        rope["factor"] = positions / rope["original_max_position_embeddings"]
    return theta, {"rope_type": kind, **rope}, partial


def _window(doc: dict[str, Any], family: str, layers: int) -> int:
    """The sliding window every layer uses (0: none); some layers only is refused."""
    if family in ("mistral", "mixtral", "phi3"):
        return _num(doc, "sliding_window", 0)
    if family not in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        types = doc.get("layer_types")
        for key, says in (("sliding_window", doc.get("sliding_window") is not None),
                          ("use_sliding_window", doc.get("use_sliding_window") not in (None, False)),
                          ("layer_types", isinstance(types, list) and "sliding_attention" in types)):
            if says:
                raise HFConfigError(f"{key}: a {family} model has no sliding window (transformers ignores it)")
        return 0
    types = doc.get("layer_types")
    use = _flag(doc, "use_sliding_window")
    if types is not None:
        if not isinstance(types, list) or not set(types) <= {"full_attention", "sliding_attention"}:
            raise HFConfigError(f"layer_types: must list full_attention / sliding_attention (got {types!r})")
        if "sliding_attention" not in types:
            return 0
        if "full_attention" in types:
            raise HFConfigError("layer_types: a sliding window on some layers only is not supported")
        return _num(doc, "sliding_window")
    if not use:
        return 0
    window = _num(doc, "sliding_window")
    if family == "qwen3_moe":
        return window
    first = _num(doc, "max_window_layers", 28, least=0)
    if first >= layers:
        return 0
    if first > 0:
        raise HFConfigError(f"max_window_layers: a sliding window on layers {first}.. only is not supported")
    return window


def _experts(doc: dict[str, Any], family: str) -> dict[str, Any]:
    if family not in MOE:
        extra = sorted(_MOE_KEYS & set(doc))
        if extra:
            raise HFConfigError(f"{extra[0]}: not a parameter of a {family} model")
        return {}
    key = "num_local_experts" if "num_local_experts" in doc else "num_experts"
    out = {"experts": _num(doc, key), "experts_per_token": _num(doc, "num_experts_per_tok"),
           "router_aux_coef": _num(doc, "router_aux_loss_coef", 0.001, float, 0)}
    if family == "mixtral":
        out["expert_ffn"] = _num(doc, "intermediate_size")
    else:
        out |= {"expert_ffn": _num(doc, "moe_intermediate_size"), "norm_topk": _flag(doc, "norm_topk_prob")}
        if _num(doc, "decoder_sparse_step", 1) != 1:
            raise HFConfigError("decoder_sparse_step: dense layers between MoE layers are not supported")
        if doc.get("mlp_only_layers") not in (None, []):
            raise HFConfigError("mlp_only_layers: dense layers between MoE layers are not supported")
    if family == "qwen2_moe":
        out["shared_expert_ffn"] = _num(doc, "shared_expert_intermediate_size", 0, least=0)
        if not _flag(doc, "qkv_bias", True):
            raise HFConfigError("qkv_bias: a qwen2_moe model without q/k/v biases is not supported")
    return out


def _token_id(doc: dict[str, Any], key: str, many: bool = False) -> Any:
    value = doc.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    if many and isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                          and v >= 0 for v in value):
        return value
    raise HFConfigError(f"{key}: must be a token id (got {value!r})")


def read_hf_config(directory: Path) -> dict[str, Any]:
    """The model-spec fields (layers, hidden, ..., tie_embeddings, family switches) of an HF
    directory. Raises HFConfigError("field: reason") for anything the decoder does not compute."""
    path = directory / "config.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:       # ValueError: not JSON, or an int of 5,000 digits
        raise HFConfigError(f"config.json: cannot read it ({' '.join(str(e).split())[:200]})") from None
    except RecursionError:
        raise HFConfigError("config.json: nested too deeply to be a model config") from None
    if not isinstance(doc, dict):
        raise HFConfigError("config.json: must be a JSON object")
    family = doc.get("model_type")
    if not isinstance(family, str) or family not in ARCHITECTURES:
        raise HFConfigError(f"model_type: {family!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    archs = doc.get("architectures") or [ARCHITECTURES[family]]
    if archs != [ARCHITECTURES[family]]:
        raise HFConfigError(f"architectures: a {family} model is {ARCHITECTURES[family]} (got {archs!r})")
    act = doc.get("hidden_activation") or doc.get("hidden_act", "gelu_pytorch_tanh" if family == "gemma" else "silu")
    want = "gelu_pytorch_tanh" if family == "gemma" else "silu"
    if act != want:
        raise HFConfigError(f"hidden_act: a {family} model computes {want!r} here (got {act!r})")
    for key in _ZERO:
        if _num(doc, key, 0.0, float, 0):
            raise HFConfigError(f"{key}: {'router jitter' if 'jitter' in key else 'dropout'} is not supported")
    if _flag(doc, "rope_interleaved") or _flag(doc, "use_bidirectional_attention"):
        raise HFConfigError(f"{'rope_interleaved' if doc.get('rope_interleaved') else 'use_bidirectional_attention'}:"
                            " not supported")
    known = _IGNORED | _SHAPE | set(_ZERO) | _MOE_KEYS | {"attention_bias", "mlp_bias", "qkv_bias", "rope_interleaved",
                                                          "use_bidirectional_attention"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise HFConfigError(f"{unknown[0]}: not supported by geotrain's decoder")
    hidden, heads = _num(doc, "hidden_size"), _num(doc, "num_attention_heads")
    layers, positions = _num(doc, "num_hidden_layers"), _num(doc, "max_position_embeddings")
    head_dim = _num(doc, "head_dim", 0)
    theta, rope, partial = _rope(doc, family, positions)
    bias = _flag(doc, "attention_bias")
    if family in ("qwen2", "qwen2_moe"):
        qkv_bias, out_bias = True, False
    else:
        qkv_bias = out_bias = bias
    if bias and family not in ("llama", "qwen3", "gemma", "qwen3_moe"):
        raise HFConfigError(f"attention_bias: not a parameter of a {family} model")
    mlp_bias = _flag(doc, "mlp_bias")
    if mlp_bias and family != "llama":
        raise HFConfigError(f"mlp_bias: not a parameter of a {family} model")
    gemma = family == "gemma"
    return {
        "family": family, "layers": layers, "hidden": hidden, "heads": heads,
        "kv_heads": _num(doc, "num_key_value_heads", heads),
        "ffn": _num(doc, "intermediate_size"), "vocab": _num(doc, "vocab_size"),
        "seq_len": positions, "max_positions": positions,
        "norm_eps": _num(doc, "rms_norm_eps", 1e-5 if family in ("phi3", "mixtral") else 1e-6, float, 1e-30),
        "rope_theta": theta, "rope_scaling": rope, "partial_rotary": partial,
        "head_size": head_dim if head_dim and (hidden % heads or head_dim != hidden // heads) else 0,
        "qkv_bias": qkv_bias, "out_bias": out_bias, "mlp_bias": mlp_bias,
        "qk_norm": family in ("qwen3", "qwen3_moe"), "sliding_window": _window(doc, family, layers),
        "act": "gelu_tanh" if gemma else "silu", "norm_offset": gemma, "embed_scale": gemma,
        **_experts(doc, family),
        "tie_embeddings": _flag(doc, "tie_word_embeddings", gemma),
        "bos_token_id": _token_id(doc, "bos_token_id"), "eos_token_id": _token_id(doc, "eos_token_id", many=True),
        "pad_token_id": _token_id(doc, "pad_token_id"),
    }
