"""Apply tensor parallelism, checkpointing, precision and data parallelism to a plain model chunk from outside.

The model file (`geotrain.models.llama`) knows nothing of distribution; like torchtitan we take
a `UnitStack` and wrap it here, in torchtitan's order: TP, then activation checkpointing
(`geotrain.runtime.activation_ckpt`), then FSDP2. Parameter names never change (no wrapper modules).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from geotrain.errors import GeotrainError
from geotrain.models.llama import Attention, Block, UnitStack
from geotrain.models.moe import MoE
from geotrain.runtime.scaler import _local
from geotrain.runtime.shared_gpu import all_reduce_staged
from geotrain.torch_compat import fsdp_post_backward_now

SHARDINGS = ("replicate", "zero1", "zero2", "zero3")
PRECISIONS = ("fp32", "bf16", "fp16")

def apply_tp(stack: UnitStack, tp_mesh) -> None:
    """Megatron-style TP inside each transformer block: wq/wk/wv and w_gate/w_up column-parallel
    (their biases split with their rows), wo and w_down row-parallel (a bias added once, after the
    all-reduce): one all-reduce after attention and one after the MLP, in forward and in backward.
    Block inputs and outputs stay full, replicated plain tensors, so norms, embedding, head and
    pipeline boundaries are unchanged; their gradients come out identical on every TP rank (the
    column-parallel input's gradient is all-reduced), so they need no TP sync. Qwen3's q/k norms
    see only the rank's heads: their weights are replicated DTensors over the heads dim
    (SequenceParallel over it), so each rank's partial weight gradient is summed over TP.
    A mixture-of-experts block splits its attention and shared expert; the router and the routed
    experts stay whole on every TP rank (expert parallelism splits the experts: `apply_ep`).

    The attention module then sees only its shard of the heads: like torchtitan, we set its head
    counts to the per-shard numbers after sharding (the model file stays free of TP)."""
    tp = tp_mesh.size()
    attention = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                 "attn.wo": RowwiseParallel()}
    mlp = {"w_gate": ColwiseParallel(), "w_up": ColwiseParallel(), "w_down": RowwiseParallel()}
    for unit in stack.units.values():
        if not isinstance(unit, Block):
            continue
        attn: Attention = unit.attn
        if attn.heads % tp or attn.kv_heads % tp:
            raise GeotrainError(f"tp={tp} does not divide heads={attn.heads} and kv_heads={attn.kv_heads}")
        plan = dict(attention)
        if attn.q_norm is not None:     # input (B, T, local heads, head_dim): sharded on dim 2
            sp = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan |= {"attn.q_norm": sp, "attn.k_norm": sp}
        if isinstance(unit.ffn, MoE):
            if unit.ffn.shared is not None:
                plan |= {f"ffn.shared.{k}": v for k, v in mlp.items()}
        else:
            plan |= {f"ffn.{k}": v for k, v in mlp.items()}
        parallelize_module(unit, tp_mesh, plan)
        # Contiguous shards keep GQA's grouping: local q head h still maps to local kv head h // (heads/kv).
        attn.heads, attn.kv_heads = attn.heads // tp, attn.kv_heads // tp


def precision_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a plan's precision: what autocast computes in, and what boundary tensors
    cross the WAN in -- the bytes the cost model, planner and simulator count (bf16/fp16: half of
    fp32). Weights stay fp32 under autocast, so the residual stream between stages is fp32 and is
    rounded only for the trip."""
    if precision not in PRECISIONS:
        raise GeotrainError(f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def autocast_context(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the autocast context for forward passes (fp32: none)."""
    dtype = precision_dtype(precision)
    if dtype == torch.float32:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device.type, dtype=dtype)


def fsdp_mixed_precision(precision: str):
    """FSDP2's MixedPrecisionPolicy for a plan's precision: bf16 gathers the weights in bf16,
    computes with them and reduce-scatters the gradients in bf16, while the shards the optimizer
    updates (the master weights) and their gradients stay fp32 -- the bytes the cost model counts
    (`costs.memory.runtime_state_bytes_per_param`, `CostModel.grad_bytes`): at the peak the bf16
    gathered weights and bf16 unsharded gradients, the fp32 shards. fp32: None (no casts).
    fp16 keeps fp32 weights under autocast, so its loss scaler unscales fp32 gradients, but the
    reduce-scatter runs in fp16 as replicated DP's all-reduce does (`allreduce_grads`): the
    2 bytes per parameter the cost model counts (an fp32 reduction moved twice that). A scaled
    gradient that overflows in the fp16 sum is an inf the scaler sees, and the step is skipped."""
    if precision == "fp16":
        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float16, cast_forward_inputs=False)
    if precision != "bf16":
        return None
    # Inputs are not cast: the residual stream stays fp32 (the model's embedding casts it up), so
    # activations are autocast's, less its per-micro-batch copies of the weights.
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, cast_forward_inputs=False)


def apply_fsdp(stack: UnitStack, mesh, sharding: str, precision: str = "fp32", ignored=()) -> nn.Module:
    """FSDP2 over the stage's DP mesh: one parameter group per block plus the chunk root.

    zero3 frees the gathered weights after each forward (re-gathered for backward); zero2
    keeps them, so only gradients and optimizer state stay sharded. In bf16 the weights are
    gathered, used and their gradients accumulated and reduced in bf16 (`fsdp_mixed_precision`);
    replicated DP and ZeRO-1 reduce in the training dtype too (`allreduce_grads`). `ignored`:
    parameters FSDP2 leaves alone (expert-parallel experts, reduced by `expert_parallel`)."""
    reshard = sharding == "zero3"
    policy = fsdp_mixed_precision(precision)
    kwargs = {"mp_policy": policy} if policy is not None else {}
    if ignored:
        kwargs["ignored_params"] = set(ignored)
    for unit in stack.units.values():
        if isinstance(unit, Block):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, **kwargs)
    fully_shard(stack, mesh=mesh, reshard_after_forward=reshard, **kwargs)
    return stack


def is_fsdp(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def fsdp_unshard(module: nn.Module) -> None:
    """Gather every FSDP2 group of a chunk now (a no-op where already gathered).

    A split backward (zero-bubble) names the weights it differentiates by `module.parameters()`
    before autograd runs; under zero3 the chunk was resharded after its forward, so that would
    name the sharded parameters -- not the gathered ones the graph used -- and the weight
    gradients went missing. PyTorch's own pipeline runtime likewise UNSHARDs a stage before its
    compute actions."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.unshard()


def fsdp_no_sync(module: nn.Module) -> None:
    """Accumulate gradients locally during the micro-batch backwards (reduce once, at ALLREDUCE)."""
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(False)
    module.set_requires_gradient_sync(False)


def fsdp_reduce_grads(module: nn.Module) -> None:
    """Run FSDP2's post-backward now: reduce-scatter the accumulated gradients over the DP group.

    This mirrors torch.distributed.pipelining's `perform_reduce_grad` (the REDUCE_GRAD action of
    PyTorch's own pipeline schedules), which is how FSDP2 is driven by a pipeline interpreter."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    fsdp_post_backward_now(fully_shard.state(module))


def allreduce_grads(params: Iterator[nn.Parameter], group: dist.ProcessGroup, size: int,
                    bucket_bytes: int = 25 * 2**20, dtype: torch.dtype = torch.float32, staged: bool = False) -> None:
    """Replicated DP: average gradients over the group in flat buckets (one collective per bucket),
    reduced in `dtype` (the training dtype: the bytes the cost model counts; fp32 gradients are
    rounded for the trip, as FSDP2's reduce_dtype does). A TP-sharded parameter's gradient is a
    DTensor: its local shard is what the replicas average. `staged`: through a host copy, over the
    group's gloo backend (ranks sharing a GPU: `runtime.shared_gpu`)."""

    grads = [_local(p.grad) for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    nbytes = 0

    def flush() -> None:
        nonlocal bucket, nbytes
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket]).to(dtype)     # one buffer, one collective
        all_reduce_staged(flat, group, staged)
        flat = flat.float().div_(size)
        for g, synced in zip(bucket, torch.split(flat, [g.numel() for g in bucket]), strict=True):
            g.copy_(synced.view_as(g))
        bucket, nbytes = [], 0

    for g in grads:
        bucket.append(g)
        nbytes += g.numel() * g.element_size()
        if nbytes >= bucket_bytes:
            flush()
    flush()

