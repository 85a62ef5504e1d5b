"""What an HF directory's safetensors hold, read from their headers alone (torch-free: the spec
checks a directory when it loads it), and whether that is exactly what the model reads.

Never silently wrong: a tensor the model does not use (Qwen2's biases under a config that says
llama) or one it needs and the files lack (an untied head without `lm_head.weight`) is a one-line
error naming the tensor -- transformers reports both. `allow_missing` lets the missing ones start
from the deterministic init instead, on purpose (the caller says so).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from geotrain.models.families import EMBED, HEAD, IGNORED_SUFFIXES, hf_tensor_names
from geotrain.models.shape import ModelShape

_MAX_HEADER = 100 * 2**20


class HFWeightsError(ValueError):
    """One line: what is missing or wrong in an HF directory's weights."""


def read_header(file: Path) -> dict[str, dict]:
    """A safetensors file's tensor table (name -> {dtype, shape, data_offsets}), from its header."""
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise HFWeightsError(f"{file}: not a safetensors file (shorter than its header size)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise HFWeightsError(f"{file}: not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise HFWeightsError(f"{file}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise HFWeightsError(f"{file}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        raise HFWeightsError(f"{file}: not a safetensors file (its header is not a tensor table)")
    header.pop("__metadata__", None)
    ends = [v.get("data_offsets") for v in header.values()]
    if not all(isinstance(e, list) and len(e) == 2 and all(isinstance(x, int) for x in e) for e in ends):
        raise HFWeightsError(f"{file}: not a safetensors file (a tensor without its data_offsets)")
    need, size = 8 + n + max((e[1] for e in ends), default=0), file.stat().st_size
    if need > size:                            # cut short (a copy or download that stopped): say so now
        raise HFWeightsError(f"{file}: truncated (its header describes {need} bytes, the file holds {size})")
    return header


def has_weights(directory: Path) -> bool:
    return (directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file()


def weight_files(directory: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (one file, or a sharded index)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
            out = {str(name): directory / str(file) for name, file in mapping.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise HFWeightsError(f"{index}: not a safetensors index ({e})") from None
        for file in sorted(set(out.values())):
            if not file.is_file() or file.resolve().parent != directory.resolve():
                raise HFWeightsError(f"{index}: names {file.name}, which is not a file in {directory}")
        return out
    single = directory / "model.safetensors"
    if not single.is_file():
        raise HFWeightsError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    return {name: single for name in read_header(single)}


def check_tensor_names(shape: ModelShape, directory: Path, tied: bool = False,
                       allow_missing: bool = False) -> list[str]:
    """Compare the directory's tensors with those the model reads: returns the missing ones when
    `allow_missing` (they start from the deterministic init), else raises on the first problem."""
    files = weight_files(directory)
    wanted = hf_tensor_names(shape, tied)
    have = {n for n in files if not n.endswith(IGNORED_SUFFIXES)}
    if tied:
        have.discard(HEAD)          # a tied model reads the embedding twice; transformers ignores a stored head
    unused = sorted(have - wanted)
    if unused:
        raise HFWeightsError(f"{directory}: tensor {unused[0]} is in the checkpoint but a {shape.family} model with "
                             f"this config.json does not use it ({len(unused)} such; is config.json's "
                             "model_type right?)")
    missing = sorted(wanted - have)
    if missing and not allow_missing:
        hint = (" (config.json says tie_word_embeddings = false: an untied head needs its own matrix)"
                if missing == [HEAD] and EMBED in have else "")
        raise HFWeightsError(f"{directory}: tensor {missing[0]} is missing{hint} ({len(missing)} missing; "
                             "allow_missing = true starts them from the init)")
    return missing
