"""Build one rank's pipeline chunk already sharded: modules on the meta device, parallelism
applied from outside, then storage for this rank's part only, filled in place.

The order is torchtitan's: the plain model (`models.llama`) is built under `torch.device("meta")`
-- shapes, no storage --, tensor parallelism, activation checkpointing and FSDP2 are applied to
it (`parallelize`; on meta tensors they only lay out shards), and `to_empty` gives each
parameter storage on the rank's device for its local shard alone. The values are then written
into that shard: from a Hugging Face directory (`models.hf_weights.load_hf_weights`, which reads only the
chunk's tensors and of each only the shard's rows), or from the deterministic init
(`models.llama.initial_rows`), which draws just the rows (and columns) the shard holds. The init
is a function of the parameter's layout-free name, so every pp split, dp, sharding and tp starts
from the same weights -- the plain model's -- and no rank ever holds a zero2/zero3 stage whole.
"""

from __future__ import annotations

import torch
from torch import nn

from geotrain.models.hf_weights import load_hf_weights
from geotrain.models.llama import Block, UnitStack, build_units, initial_rows
from geotrain.models.shards import fill_shard
from geotrain.runtime.activation_ckpt import apply_checkpointing
from geotrain.runtime.parallelize import apply_fsdp, apply_tp


def build_chunk(model, start: int, end: int, plan, mesh, device: torch.device, hf: str | None = None) -> UnitStack:
    """Units [start, end) of `model` as this rank holds them under `plan` (its tp, checkpointing
    and sharding), on `device`; `mesh` is the rank's device mesh (meshes.stage_mesh): its "tp"
    slice is the stage's TP group, of the stage's own tp."""
    with torch.device("meta"):
        module = build_units(model, start, end, init=False)
    if getattr(model, "tie_embeddings", False) and module.has_embedding and module.has_head:
        module.tie_head_to_embedding()      # one matrix; across stages the copies sum gradients (`tied`)
    if mesh["tp"].size() > 1:
        apply_tp(module, mesh["tp"])
    apply_checkpointing(module, plan.checkpointing)
    if plan.sharding in ("zero2", "zero3"):
        apply_fsdp(module, mesh["dp"], plan.sharding, plan.precision)
    materialize(module, model, device, hf)
    return module


@torch.no_grad()
def materialize(module: UnitStack, model, device: torch.device, hf: str | None = None) -> None:
    """Give a meta-built (possibly sharded) chunk storage on `device` and its initial values."""
    module.to_empty(device=device)
    for unit in module.units.values():
        if isinstance(unit, Block):
            unit.reset_rope()
    if hf:
        load_hf_weights(module, hf, model.layers, model.tie_embeddings)
        return
    for name, param in module.named_parameters():
        _, unit, rest = name.split(".", 2)          # "units.3.attn.wq.weight"
        unit = int(unit)
        if getattr(model, "tie_embeddings", False) and unit == model.num_units - 1 and rest == "out.weight":
            unit, rest = 0, "tok.weight"            # a tied head's copy starts as the embedding
        _fill(param, model, unit, rest)


def _fill(param: nn.Parameter, model, unit: int, name: str) -> None:
    """The deterministic init into `param`; a shard draws only its own rows (and keeps its columns)."""
    full_shape = tuple(param.shape)

    def rows(b):
        (shape, offset) = b
        cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
        return initial_rows(model, unit, name, full_shape, offset[0], offset[0] + shape[0])[(slice(None), *cols)]

    fill_shard(param, lambda: initial_rows(model, unit, name, full_shape), rows)
