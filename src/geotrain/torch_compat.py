"""Every private PyTorch API geotrain uses, in one place, working on each supported torch version.

Private names move between releases (FSDP2's per-module state held one `_fsdp_param_group` in
torch 2.11 and a list `_fsdp_param_groups` from 2.12); the rest of the package reaches them only
through here, and tests/test_torch_compat.py exercises each one on the torch it runs under -- the
pinned one and the oldest supported one (scripts/test.sh runs it under both). The supported range
is pyproject's `torch>=` bound up to the pinned version.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["OLDEST_TORCH", "TorchDispatchMode", "amp_unscale_", "attention_ops",
           "compute_local_shape_and_global_offset", "default_store", "flatten_state_dict", "fsdp_comm_bases",
           "fsdp_param_groups", "fsdp_post_backward_now", "get_grad_fn_or_grad_acc", "stage_backward_input",
           "stage_backward_weight", "torch_version", "tree_flatten"]

OLDEST_TORCH = (2, 11)          # the GPU machine's torch; pyproject's lower bound, tested in CI


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.11.0+cu130" -> (2, 11))."""
    parts = (version or torch.__version__).split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


# -- FSDP2 (torch.distributed.fsdp._fully_shard) --------------------------------------------------
def fsdp_param_groups(state) -> list:
    """The FSDPParamGroups of one FSDP2 module state: torch >= 2.12 keeps a list
    (`_fsdp_param_groups`, several with a per-parameter mesh), 2.11 one group or None."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def fsdp_post_backward_now(root_state) -> None:
    """Run FSDP2's post-backward of every module under the root state now (the reduce-scatter of the
    accumulated gradients), then the root's end-of-backward callback -- what
    torch.distributed.pipelining's REDUCE_GRAD action does (`perform_reduce_grad`)."""
    for st in root_state._state_ctx.all_states:
        for group in fsdp_param_groups(st):
            group.post_backward()
    root_state._root_post_backward_final_callback()


def fsdp_comm_bases() -> tuple[type, type]:
    """FSDP2's AllGather and ReduceScatter interfaces, which `FSDPModule.set_custom_all_gather` /
    `set_custom_reduce_scatter` take (the classes live in a private module)."""
    # lazy: FSDP2's internals only where a custom communication is built
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


# -- torch.distributed ----------------------------------------------------------------------------
def default_store() -> dist.Store:
    """The default process group's key-value store (the rendezvous's TCPStore)."""
    return dist.distributed_c10d._get_default_store()


def compute_local_shape_and_global_offset(shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of a DTensor of `shape` (what DCP uses)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as f  # lazy: DTensor internals

    shape_, offset = f(shape, mesh, placements)
    return tuple(shape_), tuple(offset)


def flatten_state_dict(state: dict) -> tuple[dict[str, Any], dict]:
    """DCP's flattening of a nested state dict into dotted keys (the keys a checkpoint stores)."""
    # lazy: torch.distributed.checkpoint is heavy and only checkpoint code needs it
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as f

    return f(state)


# -- torch.distributed.pipelining._backward (the zero-bubble split backward) ---------------------------
def stage_backward_input(outputs: list[torch.Tensor], output_grads: list[torch.Tensor] | None,
                         inputs: list[torch.Tensor], weights: Iterator[torch.nn.Parameter]):
    """Input gradients only; returns (input grads, param_groups) for `stage_backward_weight`."""
    # lazy: torch.distributed.pipelining takes seconds to import; only a split backward needs it
    from torch.distributed.pipelining._backward import stage_backward_input as f

    return f(outputs, output_grads, inputs, weights)


def stage_backward_weight(weights: Iterator[torch.nn.Parameter], param_groups: list[dict]):
    """The weight gradients deferred by `stage_backward_input`, accumulated into `.grad`."""
    # lazy: torch.distributed.pipelining takes seconds to import; only a split backward needs it
    from torch.distributed.pipelining._backward import stage_backward_weight as f

    return f(weights, param_groups)


def get_grad_fn_or_grad_acc(t: torch.Tensor):
    """The autograd node that receives `t`'s gradient: its grad_fn, or a leaf's AccumulateGrad."""
    # lazy: torch.distributed.pipelining takes seconds to import; only a split backward needs it
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc as f

    return f(t)


# -- autocast / ops ---------------------------------------------------------------------------------
def amp_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's fused kernel: multiply `grads` by `inv_scale` in place and set `found_inf` to 1
    if any is inf or NaN (grads on one device, found_inf/inv_scale on it too)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


_ATTENTION_OP_NAMES = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                       "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention")


def attention_ops() -> set:
    """The aten overloads scaled_dot_product_attention dispatches to (per backend), those this torch has."""
    out = set()
    for name in _ATTENTION_OP_NAMES:
        try:
            out.add(getattr(torch.ops.aten, name).default)
        except (AttributeError, RuntimeError):      # not built into this torch
            continue
    return out
