"""A training run's latest distributed checkpoint as a Hugging Face Llama directory.

The checkpoint is read with torch.distributed.checkpoint in one process (`no_dist`), only the
model tensors (not the optimizer state): DCP assembles FSDP2 shards and the stages' slices into
full tensors by name, `model.units.{i}.*` (the plain model's names, whatever the layout). The names are mapped to HF's
(`models.hf_weights`), written with safetensors beside a config.json, so `transformers` loads the
directory as it loads any LlamaForCausalLM.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from geotrain.errors import GeotrainError
from geotrain.layout.plan import load_plan, plan_spec
from geotrain.models.families import hf_config
from geotrain.models.hf_weights import to_hf_state

_EXPORT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"}
_KEY = re.compile(r"^model\.(units\.\d+\..+)$")


def latest_checkpoint(run_dir: Path) -> Path:
    pointer = run_dir / "checkpoints" / "latest"
    path = run_dir / "checkpoints" / pointer.read_text().strip() if pointer.is_file() else None
    if path is None or not (path / ".metadata").is_file():
        raise GeotrainError(f"{run_dir}: no complete checkpoint in {run_dir / 'checkpoints'} (train with "
                            "--checkpoint-every N, or job.checkpoint_every, to save one)")
    return path


def checkpoint_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """`units.{i}.*` -> full tensor, read from a DCP checkpoint directory (model state only)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    wanted: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for key, info in meta.state_dict_metadata.items():
        m = _KEY.match(key)
        if m and isinstance(info, TensorStorageMetadata):
            wanted[key] = torch.empty(info.size, dtype=info.properties.dtype)
            names[key] = m.group(1)
    if not wanted:
        raise GeotrainError(f"{path}: no model tensors in this checkpoint")
    with warnings.catch_warnings():   # "torch.distributed is uninitialized": one process is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(wanted, checkpoint_id=str(path), no_dist=True)
    return {names[k]: t for k, t in wanted.items()}


def run_model_spec(run_dir: str | Path):
    """The model spec a training run trained (from its plan.json's embedded experiment)."""
    run_dir = Path(run_dir)
    if not (run_dir / "plan.json").is_file():
        raise GeotrainError(f"{run_dir}: not a training run directory (no plan.json)")
    _, doc = load_plan(run_dir / "plan.json")
    return plan_spec(doc, run_dir / "plan.json").model   # the experiment the plan file carries


def export_run(run_dir: str | Path, out: str | Path, dtype: str = "float32") -> tuple[Path, object]:
    """export_hf for a run directory: its own model spec and, for a model that came from an HF
    directory, that directory's tokenizer files. Returns (OUT, model spec)."""
    model = run_model_spec(run_dir)
    return export_hf(run_dir, out, model, tokenizer_dir=model.hf, dtype=dtype), model


def export_hf(run_dir: str | Path, out: str | Path, model_spec, tokenizer_dir: str | None = None,
              dtype: str = "float32") -> Path:
    """Write OUT/config.json + OUT/model.safetensors (+ the tokenizer files of the model's HF source)."""
    # lazy: safetensors only when called (importers that never call it stay free of it)
    from safetensors.torch import save_file


    run_dir, out = Path(run_dir), Path(out)
    if out.exists():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in _EXPORT_FILES) if out.is_dir() else [out.name]
        if foreign:
            raise GeotrainError(f"--hf {out}: exists and holds {', '.join(foreign[:3])}; an export replaces its "
                                "directory whole, so give a new (or empty, or previously exported) one")
    tensors = checkpoint_model_tensors(latest_checkpoint(run_dir))
    expected = {f"units.{i}" for i in range(model_spec.num_units)}
    have = {".".join(n.split(".")[:2]) for n in tensors}
    if have != expected:
        raise GeotrainError(f"{run_dir}: the checkpoint holds units {sorted(have)}, the model has "
                            f"{model_spec.num_units}: not this run's model")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise GeotrainError(f"--dtype: {dtype!r} is not float32, bfloat16 or float16")
    tied = bool(getattr(model_spec, "tie_embeddings", False))   # written tied: no lm_head, tie_word_embeddings
    state = {k: t.to(getattr(torch, dtype)) for k, t in to_hf_state(tensors.items(), model_spec, tied).items()}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config(model_spec, dtype), indent=2) + "\n")
    if tokenizer_dir:
        for name in sorted(_EXPORT_FILES - {"config.json", "model.safetensors"}):
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy(Path(tokenizer_dir) / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)            # a previous export (checked above): replaced whole
    os.rename(tmp, out)
    return out
