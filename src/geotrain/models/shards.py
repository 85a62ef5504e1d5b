"""Write a tensor's values into a parameter as this rank holds it: whole, or only its shard.

One routine for every source of values -- an HF checkpoint (`hf.load_hf_weights`) and the
deterministic init (`runtime.materialize`) -- so the two can never disagree on which block of the
full tensor a shard is. A source gives the full tensor, or just a block of it (rows and columns:
what safetensors slices from a memory-mapped file, what `llama.initial_rows` draws).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from geotrain.models.llama import initial_rows
from geotrain.torch_compat import compute_local_shape_and_global_offset

Block = tuple[tuple[int, ...], tuple[int, ...]]          # (shape, offset) in the full tensor


def local_block(param) -> Block | None:
    """(shape, offset) of the block of the full tensor that a DTensor's local shard is, for layouts
    made of plain Shard/Replicate placements (FSDP2 alone, TP alone, both on separate dims); None
    for any other (FSDP2 over TP's shards of the same dim is strided)."""
    # DTensor's own arithmetic of where a local shard sits (what DCP uses to save it); private -- no
    # public function giving a shard's global offset was found.
    if any(type(pl) not in (Shard, Replicate) for pl in param.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(param.to_local().shape):
        return None
    return tuple(shape), tuple(offset)


def fill_shard(param, full: Callable[[], torch.Tensor], block: Callable[[Block], torch.Tensor]) -> None:
    """Copy the values into `param`: `full()` for a plain tensor, `block((shape, offset))` for a
    sharded one (only its own part is ever produced), and for a strided layout the full tensor cut
    locally (`distribute_tensor(..., src_data_rank=None)`: no communication)."""
    if not isinstance(param, DTensor):
        param.copy_(full())
        return
    local = param.to_local()
    if local.numel() == 0:
        return
    where = local_block(param)
    if where is not None:
        local.copy_(block(where))
        return
    whole = full().to(device=local.device, dtype=param.dtype)
    local.copy_(distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local())


def fill_initial(param, spec, unit: int, name: str) -> None:
    """The deterministic init (`llama.initial_rows`) into `param`; a shard draws only its own rows
    (and keeps its columns)."""
    full_shape = tuple(param.shape)

    def rows(b):
        (shape, offset) = b
        cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
        return initial_rows(spec, unit, name, full_shape, offset[0], offset[0] + shape[0])[(slice(None), *cols)]

    fill_shard(param, lambda: initial_rows(spec, unit, name, full_shape), rows)
