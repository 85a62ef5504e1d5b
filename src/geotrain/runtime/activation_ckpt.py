"""Activation checkpointing applied to a plain model chunk from outside (torch.utils.checkpoint).

The model file knows nothing of it: like torchtitan we replace each transformer block's forward
by a checkpointed call after tensor parallelism and before FSDP2. Parameter names never change
(no wrapper modules), so a checkpoint written under one checkpointing mode loads under another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch.autograd.graph import GradientEdge
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from geotrain.costs.activations import CHECKPOINTING
from geotrain.errors import GeotrainError
from geotrain.models.llama import Block, UnitStack
from geotrain.torch_compat import attention_ops, get_grad_fn_or_grad_acc

_MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
_ATTENTION_OPS = attention_ops()
# Per selective policy, the ops whose outputs a block keeps; everything else in the block is
# recomputed in backward. Norms, RoPE, SiLU and elementwise products are cheap FLOPs with large
# outputs, so every policy recomputes them; the policies differ in the expensive ops they keep.
SAVE_OPS = {
    "selective": _MATMUL_OPS | _ATTENTION_OPS,   # recompute only the elementwise ops
    "keep-matmul": _MATMUL_OPS,                  # also recompute attention (s^2 FLOPs, no weights)
    "keep-attention": _ATTENTION_OPS,            # recompute every matmul, keep attention's output
}


def _policy(save_ops: frozenset):
    def policy(ctx, op, *args, **kwargs):  # noqa: ANN001 -- torch's policy signature
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpointed(forward: Callable, mode: str) -> Callable:
    if mode in SAVE_OPS:
        ctx_fn = functools.partial(create_selective_checkpoint_contexts, _policy(frozenset(SAVE_OPS[mode])))

        @functools.wraps(forward)
        def run(*args):
            return checkpoint(forward, *args, use_reentrant=False, context_fn=ctx_fn)
    else:

        @functools.wraps(forward)
        def run(*args):
            return checkpoint(forward, *args, use_reentrant=False)

    return run


def apply_checkpointing(stack: UnitStack, mode: str) -> None:
    """full: recompute each transformer block in backward (keep only its input); a selective
    policy (SAVE_OPS): per block, keep the outputs of its ops, recompute the rest."""
    if mode not in CHECKPOINTING:
        raise GeotrainError(f"unknown checkpointing mode {mode!r} (known: {', '.join(CHECKPOINTING)})")
    stack.checkpointing = mode  # read by the pipeline's split backward (`weight_gradients_in_one_pass`)
    if mode == "none":
        return
    for unit in stack.units.values():
        if isinstance(unit, Block):
            # An instance attribute shadows the class's forward; module hooks (FSDP's unshard)
            # still run around it in __call__, outside the checkpointed region.
            unit.forward = _checkpointed(unit.forward, mode)


def weight_gradients_in_one_pass(weights: Iterable[torch.nn.Parameter], param_groups: list[dict]) -> None:
    """A split backward's W for a checkpointed chunk: every parameter group's weight gradients in
    ONE autograd pass, from the gradients B hooked at the groups' intermediates.

    torch.distributed.pipelining's `stage_backward_weight` runs one `autograd.grad` per group;
    non-reentrant checkpointing recomputes a region once per autograd pass, and keeps each pass's
    recomputed tensors until the region's frame dies, so under full checkpointing W recomputed a
    block about once per matmul and held them all (measured on `tiny`, fp32: 4.3 MB for a block
    whose activations are 0.65 MB). One pass recomputes each region once. Each intermediate's
    incoming gradient is clamped to the one B saved, as torch does for groups of several
    intermediates, so a gradient reaching an intermediate through another is not counted twice."""
    weight_of = {get_grad_fn_or_grad_acc(w): w for w in weights}
    edges, grads_out, targets, handles = [], [], [], []
    for group in param_groups:
        for saved, node in zip(group.pop("grads", None) or (), group.pop("intermediates"), strict=False):
            handles.append(node.register_prehook(lambda _grads, saved=saved: saved))
            for i, g in enumerate(saved):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads_out.append(g)
        targets.extend(group["params"])
    if not edges:
        return
    try:
        dweights = torch.autograd.grad(edges, [GradientEdge(t, 0) for t in targets], grad_outputs=grads_out,
                                       allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for node, dw in zip(targets, dweights, strict=True):
        w = weight_of[node]
        if dw is None:
            continue
        w.grad = dw if w.grad is None else w.grad + dw
