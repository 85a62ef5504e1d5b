"""A Hugging Face Llama `config.json` read into geotrain's model-shape fields.

Only what geotrain's decoder computes is accepted: the Llama family with SiLU SwiGLU MLPs,
RMSNorm, plain (unscaled) RoPE, grouped-query attention, no biases, tied or untied embeddings.
Anything else is refused with one line naming the `config.json` field, since loading weights
into a model that computes something else would train or serve garbage without an error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ARCHITECTURES = ("LlamaForCausalLM",)

# Fields that change nothing geotrain computes (bookkeeping, generation defaults, init).
_IGNORED = {
    "transformers_version", "architectures", "output_hidden_states", "output_attentions", "return_dict",
    "dtype", "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "initializer_range", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
    "pretraining_tp", "_name_or_path", "model_type", "tokenizer_class", "tie_word_embeddings",
}


class HFConfigError(ValueError):
    """`field: reason` about a config.json."""


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _get(doc: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in doc:
        raise HFConfigError(f"{key}: required field is missing")
    value = doc[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise HFConfigError(f"{key}: must be a number (got {value!r})")
    return value


def read_hf_config(directory: Path) -> dict[str, Any]:
    """The model-spec fields (layers, hidden, ..., tie_embeddings) of an HF Llama directory.
    Raises HFConfigError("field: reason") for anything geotrain's decoder does not compute."""
    path = directory / "config.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFConfigError(f"config.json: cannot read it ({' '.join(str(e).split())})") from None
    if not isinstance(doc, dict):
        raise HFConfigError("config.json: must be a JSON object")
    if doc.get("model_type") != "llama":
        raise HFConfigError(f"model_type: only 'llama' is supported (got {doc.get('model_type')!r})")
    archs = doc.get("architectures") or list(ARCHITECTURES)
    if list(archs) != list(ARCHITECTURES):
        raise HFConfigError(f"architectures: only {ARCHITECTURES[0]} is supported (got {archs})")
    if doc.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"hidden_act: only 'silu' is supported (got {doc['hidden_act']!r})")
    for flag in ("attention_bias", "mlp_bias"):
        if doc.get(flag):
            raise HFConfigError(f"{flag}: biases are not supported")
    if doc.get("attention_dropout", 0.0):
        raise HFConfigError("attention_dropout: dropout is not supported")
    theta = doc.get("rope_theta", 10000.0)
    rope = doc.get("rope_parameters") or doc.get("rope_scaling")
    if rope is not None:
        if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
            raise HFConfigError(f"rope_parameters: only plain RoPE (rope_type 'default') is supported (got {rope})")
        theta = rope.get("rope_theta", theta)
    hidden = _get(doc, "hidden_size", int)
    heads = _get(doc, "num_attention_heads", int)
    head_dim = doc.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != hidden:
        raise HFConfigError(f"head_dim: {head_dim} x {heads} heads must equal hidden_size {hidden}")
    known = _IGNORED | {"hidden_act", "attention_bias", "mlp_bias", "attention_dropout", "rope_theta",
                        "rope_parameters", "rope_scaling", "head_dim", "hidden_size", "num_attention_heads",
                        "num_key_value_heads", "intermediate_size", "num_hidden_layers", "vocab_size",
                        "max_position_embeddings", "rms_norm_eps"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise HFConfigError(f"{unknown[0]}: not supported by geotrain's Llama decoder")
    tie = doc.get("tie_word_embeddings", False)  # LlamaConfig's default
    if not isinstance(tie, bool):
        raise HFConfigError(f"tie_word_embeddings: must be true or false (got {tie!r})")
    return {
        "layers": _get(doc, "num_hidden_layers", int),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": doc.get("num_key_value_heads") or heads,
        "ffn": _get(doc, "intermediate_size", int),
        "vocab": _get(doc, "vocab_size", int),
        "seq_len": _get(doc, "max_position_embeddings", int),
        "norm_eps": float(_get({"rms_norm_eps": 1e-6, **doc}, "rms_norm_eps", (int, float))),  # LlamaConfig's
        "rope_theta": float(theta),
        "tie_embeddings": tie,
    }
