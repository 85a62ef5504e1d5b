"""Hugging Face weights in and out of geotrain's units, through safetensors.

geotrain's decoder computes what transformers' classes compute (same RoPE halves convention,
RMSNorm, gated MLP, GQA, each family's switches), so the mapping is a rename
(`models.families.hf_sources`): `units.{i}.attn.wq.weight` is `model.layers.{i-1}.self_attn.q_proj.weight`;
Phi-3's fused qkv_proj / gate_up_proj are read as row blocks and concatenated again on export;
a MoE block's stacked experts are read from, and written as, one tensor per expert.

Loading reads tensor by tensor with `safe_open` (memory-mapped), only the tensors of the units a
stage holds -- a rank never reads another stage's weights, nor the whole file. A sharded
parameter (FSDP2's rows, TP's rows or columns, expert parallelism's experts) reads only its own
block (`get_slice`); only a strided layout (FSDP2 over TP's shards of the same dim) reads the
stage's tensor and keeps its own part (`distribute_tensor(..., src_data_rank=None)`: no communication).

A tied checkpoint (lm_head = embed_tokens) trains tied: a chunk that holds both ends holds one
matrix, a pipeline keeps a copy on its first and last stage whose gradients are summed every
step (`runtime.tied`), and each copy loads `embed_tokens`. An export of a tied model writes
`tie_word_embeddings: true` and no `lm_head.weight`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from geotrain.models.families import EMBED, HEAD, Source, hf_config, hf_sources  # noqa: F401 -- re-exported
from geotrain.models.hf_files import HFWeightsError, check_tensor_names, weight_files  # noqa: F401 -- re-exported
from geotrain.models.shape import as_shape
from geotrain.models.shards import fill_initial, fill_shard

Block = tuple[tuple[int, ...], tuple[int, ...]]


def _split(name: str) -> tuple[int, str]:
    """"units.3.attn.wq.weight" -> (3, "attn.wq.weight")."""
    _, unit, rest = name.split(".", 2)
    return int(unit), rest


class _Reader:
    """A parameter's values from its Source, whole or one block, across the open files."""

    def __init__(self, handles: dict[str, object], src: Source):
        self.handles, self.src = handles, src

    def _slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.handles[name].get_slice(name)[index]

    def shape(self) -> tuple[int, ...]:
        first = tuple(self.handles[self.src.names[0]].get_slice(self.src.names[0]).get_shape())
        for n in self.src.names[1:]:
            if tuple(self.handles[n].get_slice(n).get_shape()) != first:
                raise HFWeightsError(f"{n}: shape differs from {self.src.names[0]}'s")
        if len(self.src.names) > 1:
            return (len(self.src.names), *first)
        if self.src.rows is not None:
            if self.src.rows[0] + self.src.rows[1] > first[0]:
                raise HFWeightsError(f"{self.src.names[0]}: {first[0]} rows, fewer than its fused parts need")
            return (self.src.rows[1], *first[1:])
        return first

    def block(self, b: Block) -> torch.Tensor:
        shape, offset = b
        rest = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
        if len(self.src.names) > 1:
            names = self.src.names[offset[0]:offset[0] + shape[0]]
            return torch.stack([self._slice(n, rest) for n in names])
        first = self.src.rows[0] if self.src.rows else 0
        return self._slice(self.src.names[0], (slice(first + offset[0], first + offset[0] + shape[0]), *rest))

    def full(self, shape: tuple[int, ...]) -> torch.Tensor:
        if len(self.src.names) == 1 and self.src.rows is None:
            return self.handles[self.src.names[0]].get_tensor(self.src.names[0])
        return self.block((shape, (0,) * len(shape)))


@torch.no_grad()
def load_hf_weights(stack: nn.Module, directory: str | Path, tied: bool = False,
                    allow_missing: bool = False) -> tuple[list[str], list[str]]:
    """Fill the parameters of a stage (`units.{i}.*` names, plain or sharded) from an HF
    directory. Returns (HF tensor names read, parameters started from the init because the
    directory lacks them -- only with `allow_missing`, else that is an error). Shapes must match."""
    # lazy: safetensors only when called (importers that never call it stay free of it)
    from safetensors import SafetensorError, safe_open

    shape = as_shape(stack.spec)
    directory = Path(directory)
    missing = set(check_tensor_names(shape, directory, tied, allow_missing))
    files = weight_files(directory)
    plan, fresh = [], []
    for name, param in stack.named_parameters():
        unit, rest = _split(name)
        src = hf_sources(shape, unit, tied).get(rest)
        if src is None:
            raise HFWeightsError(f"no HF tensor for parameter {name}")
        if missing & set(src.names):
            if tied and src.names == (EMBED,):
                unit, rest = 0, "tok.weight"        # a tied head's copy starts as the embedding
            fill_initial(param, shape, unit, rest)
            fresh.append(name)
            continue
        plan.append((name, param, src))
    read = []
    try:
        _read_into(plan, files, {}, read, safe_open)
    except (SafetensorError, OSError) as e:          # a truncated or garbled file whose header looked right
        raise HFWeightsError(f"{directory}: a safetensors file cannot be read ({' '.join(str(e).split())[:160]})") \
            from None
    return read, fresh


def _read_into(plan, files, handles, read, safe_open) -> None:
    with contextlib.ExitStack() as stack_:
        opened: dict[Path, object] = {}
        for _, _, src in plan:
            for n in src.names:
                f = files[n]
                if f not in opened:
                    opened[f] = stack_.enter_context(safe_open(str(f), framework="pt"))
                handles[n] = opened[f]
        for name, param, src in plan:
            reader = _Reader(handles, src)
            full_shape = reader.shape()
            if full_shape != tuple(param.shape):
                raise HFWeightsError(f"{src.names[0]}: shape {full_shape} in the checkpoint, "
                                     f"{tuple(param.shape)} in the model ({name})")
            fill_shard(param, lambda r=reader, s=full_shape: r.full(s), reader.block)
            read.extend(src.names)


def to_hf_state(params: Iterable[tuple[str, torch.Tensor]], spec, tied: bool = False) -> dict[str, torch.Tensor]:
    """geotrain `units.{i}.*` tensors (full, not sharded) -> HF names, contiguous, for save_file:
    fused tensors concatenated from their row blocks, stacked experts one tensor each.
    Tied: the head's copy of the embedding is left out (HF ties it back on load)."""
    shape = as_shape(spec)
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, t in params:
        unit, rest = _split(name)
        if tied and unit == shape.layers + 1 and rest == "out.weight":
            continue
        src = hf_sources(shape, unit)[rest]
        t = t.detach()
        if len(src.names) > 1:
            out.update({n: t[e].contiguous() for e, n in enumerate(src.names)})
        elif src.rows is not None:
            fused.setdefault(src.names[0], []).append((src.rows[0], t))
        else:
            out[src.names[0]] = t.contiguous()
    for n, parts in fused.items():
        out[n] = torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]).contiguous()
    return out
