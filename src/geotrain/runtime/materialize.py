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

import sys

import torch
from torch.distributed.tensor import DTensor

from geotrain.models.hf_weights import load_hf_weights
from geotrain.models.llama import Block, UnitStack, build_units
from geotrain.models.shards import fill_initial
from geotrain.runtime.activation_ckpt import apply_checkpointing
from geotrain.runtime.expert_parallel import apply_ep, split_expert_params
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
    apply_ep(module, mesh)
    apply_checkpointing(module, plan.checkpointing)
    if plan.sharding in ("zero2", "zero3"):     # EP-split experts stay out of FSDP2 (`expert_parallel`)
        apply_fsdp(module, mesh["dp"], plan.sharding, plan.precision, ignored=split_expert_params(module)[1])
    materialize(module, model, device, hf)
    return module


@torch.no_grad()
def materialize(module: UnitStack, model, device: torch.device, hf: str | None = None) -> None:
    """Give a meta-built (possibly sharded) chunk storage on `device` and its initial values."""
    tied = module.has_embedding and module.has_head and \
        module.units[str(module.end - 1)].out.weight is module.units["0"].tok.weight
    module.to_empty(device=device)
    if tied and not isinstance(module.units["0"].tok.weight, DTensor):
        # to_empty gives each module its own new Parameter when the device type changes (meta ->
        # cpu/cuda), so the one tied matrix came out as two: tie them again (FSDP2 keeps its one
        # sharded Parameter). Two copies trained alike, but the gradient norm counted the matrix twice.
        module.tie_head_to_embedding()
    for unit in module.units.values():
        if isinstance(unit, Block):
            unit.reset_rope()
    if hf:
        _, fresh = load_hf_weights(module, hf, model.tie_embeddings, getattr(model, "allow_missing", False))
        if fresh:
            print(f"geotrain: allow_missing: {len(fresh)} parameter(s) of units [{module.start}, {module.end}) "
                  f"are not in {hf} and start from the init: {', '.join(fresh[:4])}"
                  f"{', ...' if len(fresh) > 4 else ''}", file=sys.stderr, flush=True)
        return
    for name, param in module.named_parameters():
        _, unit, rest = name.split(".", 2)          # "units.3.attn.wq.weight"
        unit = int(unit)
        if getattr(model, "tie_embeddings", False) and unit == model.num_units - 1 and rest == "out.weight":
            unit, rest = 0, "tok.weight"            # a tied head's copy starts as the embedding
        fill_initial(param, model, unit, rest)
