"""Hugging Face Llama weights in and out of geotrain's units, through safetensors.

geotrain's decoder computes what `transformers`' LlamaForCausalLM computes (same RoPE halves
convention, same RMSNorm, SwiGLU, GQA), so the mapping is a rename: `units.{i}.attn.wq.weight`
is `model.layers.{i-1}.self_attn.q_proj.weight`, and so on (`hf_names`).

Loading reads tensor by tensor with `safe_open` (memory-mapped), only the tensors of the units a
stage holds -- a rank never reads another stage's weights, nor the whole file. A sharded
parameter (FSDP2's rows, TP's rows or columns) reads only its own block (`get_slice`); only a
strided layout (FSDP2 over TP's shards of the same dim) reads the stage's tensor and keeps its own
part (`distribute_tensor(..., src_data_rank=None)`: cut locally, no communication).

A tied checkpoint (lm_head = embed_tokens) trains tied: a chunk that holds both ends holds one
matrix, a pipeline keeps a copy on its first and last stage whose gradients are summed every
step (`runtime.tied`), and each copy loads `embed_tokens`. An export of a tied model writes
`tie_word_embeddings: true` and no `lm_head.weight`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from geotrain.models.shards import fill_shard

_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w_gate.weight": "mlp.gate_proj.weight",
    "ffn.w_up.weight": "mlp.up_proj.weight",
    "ffn.w_down.weight": "mlp.down_proj.weight",
}
EMBED, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


class HFWeightsError(ValueError):
    """One line: what is missing or wrong in an HF directory's weights."""


def hf_names(layers: int, unit: int, tied: bool = False) -> dict[str, str]:
    """geotrain parameter name inside unit `unit` (e.g. "attn.wq.weight") -> HF tensor name."""
    if unit == 0:
        return {"tok.weight": EMBED}
    if unit == layers + 1:
        return {"norm.weight": NORM, "out.weight": EMBED if tied else HEAD}
    if 1 <= unit <= layers:
        return {ours: f"model.layers.{unit - 1}.{theirs}" for ours, theirs in _BLOCK.items()}
    raise IndexError(f"unit {unit} out of range 0..{layers + 1}")


def weight_files(directory: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (one file, or a sharded index)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HFWeightsError(f"{index}: not a safetensors index ({e})") from None
        return {name: directory / file for name, file in mapping.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise HFWeightsError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    # lazy: safetensors only when called (importers that never call it stay free of it)
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 -- safe_open has no __iter__


def _split(name: str) -> tuple[int, str]:
    """"units.3.attn.wq.weight" -> (3, "attn.wq.weight")."""
    _, unit, rest = name.split(".", 2)
    return int(unit), rest


def _load_one(f, hf: str, name: str, param) -> None:
    """Read one tensor into `param`: only its own block for a sharded parameter (safetensors
    slices the memory-mapped file: FSDP2's rows, TP's rows or columns), else the whole tensor, cut
    locally for a strided DTensor layout (`shards.fill_shard`)."""
    full_shape = tuple(f.get_slice(hf).get_shape())
    if full_shape != tuple(param.shape):
        raise HFWeightsError(f"{hf}: shape {full_shape} in the checkpoint, {tuple(param.shape)} in the model ({name})")
    fill_shard(param, lambda: f.get_tensor(hf),
               lambda b: f.get_slice(hf)[tuple(slice(o, o + n) for o, n in zip(b[1], b[0], strict=True))])


@torch.no_grad()
def load_hf_weights(stack: nn.Module, directory: str | Path, layers: int, tied: bool = False) -> list[str]:
    """Fill the parameters of a stage (`units.{i}.*` names, plain or sharded) from an HF
    directory; returns the HF tensor names read. Shapes must match exactly."""
    # lazy: safetensors only when called (importers that never call it stay free of it)
    from safetensors import safe_open

    files = weight_files(Path(directory))
    wanted: dict[Path, list[tuple[str, str, torch.Tensor]]] = {}
    for name, param in stack.named_parameters():
        unit, rest = _split(name)
        hf = hf_names(layers, unit, tied).get(rest)
        if hf is None:
            raise HFWeightsError(f"no HF tensor for parameter {name}")
        if hf == HEAD and hf not in files and EMBED in files:
            hf = EMBED                      # a tied checkpoint that omits lm_head
        if hf not in files:
            raise HFWeightsError(f"{directory}: tensor {hf} is missing")
        wanted.setdefault(files[hf], []).append((name, hf, param))
    read = []
    for file, items in wanted.items():
        with safe_open(str(file), framework="pt") as f:
            for name, hf, param in items:
                _load_one(f, hf, name, param)
                read.append(hf)
    return read


def to_hf_state(params: Iterable[tuple[str, torch.Tensor]], layers: int, tied: bool = False) -> dict[str, torch.Tensor]:
    """geotrain `units.{i}.*` tensors (full, not sharded) -> HF names, contiguous, for save_file.
    Tied: the head's copy of the embedding is left out (HF ties it back on load)."""
    out = {}
    for name, t in params:
        unit, rest = _split(name)
        if tied and unit == layers + 1 and rest == "out.weight":
            continue
        out[hf_names(layers, unit)[rest]] = t.detach().contiguous()
    return out


def hf_config(spec, dtype: str = "float32") -> dict:
    """The config.json of an export (tied exactly when the model trained tied)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim, "hidden_act": "silu",
        "max_position_embeddings": spec.seq_len, "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": bool(getattr(spec, "tie_embeddings", False)), "torch_dtype": dtype,
        "initializer_range": 0.02,
    }
