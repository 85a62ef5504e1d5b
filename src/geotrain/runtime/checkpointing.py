"""Activation checkpointing applied to a plain model chunk from outside (torch.utils.checkpoint).

The model file knows nothing of it: like torchtitan we replace each transformer block's forward
by a checkpointed call after tensor parallelism and before FSDP2. Parameter names never change
(no wrapper modules), so a checkpoint written under one checkpointing mode loads under another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from geotrain.errors import GeotrainError
from geotrain.models.llama import Block, UnitStack

CHECKPOINTING = ("none", "full", "selective")

# Ops whose outputs selective checkpointing keeps; everything else in a block (norms, RoPE,
# SiLU, elementwise products) is recomputed in backward -- cheap FLOPs, large activations.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(ctx, op, *args, **kwargs):  # noqa: ANN001 -- torch's policy signature
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward: Callable, selective: bool) -> Callable:
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if selective:
        ctx_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)

        @functools.wraps(forward)
        def run(*args):
            return checkpoint(forward, *args, use_reentrant=False, context_fn=ctx_fn)
    else:

        @functools.wraps(forward)
        def run(*args):
            return checkpoint(forward, *args, use_reentrant=False)

    return run


def apply_checkpointing(stack: UnitStack, mode: str) -> None:
    """full: recompute each transformer block in backward (keep only its input);
    selective: per block, keep matmul and attention outputs, recompute the rest."""
    if mode not in CHECKPOINTING:
        raise GeotrainError(f"unknown checkpointing mode {mode!r} (known: {', '.join(CHECKPOINTING)})")
    if mode == "none":
        return
    for unit in stack.units.values():
        if isinstance(unit, Block):
            # An instance attribute shadows the class's forward; module hooks (FSDP's unshard)
            # still run around it in __call__, outside the checkpointed region.
            unit.forward = _checkpointed(unit.forward, selective=mode == "selective")
