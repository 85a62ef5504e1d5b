"""Expert parallelism, applied to a plain model chunk from outside like TP (`parallelize`).

Each MoE block's routed experts are split over the "ep" dim of the rank's mesh (`ep` consecutive
DP replicas of a stage, inside its DC) and, under TP, each expert's rows over "tp": the stacked
weights become DTensors, so DCP, the HF loader's per-shard reads and the deterministic init see
each rank's block of one logical tensor. `ExpertDispatch` moves routed rows to their expert's rank
and back with `all_to_all_single`; `reduce_expert_grads` sums expert gradients over the replicas
that hold the same experts. FSDP2 shards the rest of the chunk and leaves the split experts alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from geotrain.errors import GeotrainError
from geotrain.models.llama import Block, UnitStack
from geotrain.models.moe import MoE, expert_mlp

_ROWS_DIM = {"w_gate": 1, "w_up": 1, "w_down": 2}     # each expert's intermediate rows


class _IntoTP(torch.autograd.Function):
    """Identity forward; the input gradient (partial per TP rank) summed over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _OutOfTP(torch.autograd.Function):
    """The TP ranks' partial outputs summed; the gradient passes through (it is the same on every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertDispatch:
    """MoE.dispatch for a rank holding experts [rank_in_ep * E/ep, ...) (and 1/tp of their rows).

    Rows routed to an expert travel to its rank with `all_to_all_single` (counts first, then the
    rows, in the compute dtype), run through the local experts and travel back; the functional
    collectives' all_to_all_single_autograd carries the gradients. Under TP every rank of a TP
    group routes the same rows, computes its slice of the experts' rows, and the partial outputs
    are summed over the group (Megatron's pair: identity forward / all-reduce backward on the way
    in, the reverse on the way out)."""

    def __init__(self, experts: int, ep_group, ep: int, tp_group, tp: int):
        self.experts, self.ep_group, self.ep, self.tp_group, self.tp = experts, ep_group, ep, tp_group, tp
        self.local = experts // ep
        self.sent_bytes = 0          # rows' bytes this rank sent to other ranks (both ways), for the bench

    def __call__(self, module: nn.Module, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(xs.device.type):      # travel in the compute dtype the matmuls use
            xs = xs.to(torch.get_autocast_dtype(xs.device.type))
        ep, n = self.ep, self.local
        if ep > 1:
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=self.ep_group)     # rows per (source, local expert)
            by_source = recv.view(ep, n)
            send_splits = counts.view(ep, n).sum(1).tolist()
            recv_splits = by_source.sum(1).tolist()
            got = funcol.all_to_all_single_autograd(xs.contiguous(), recv_splits, send_splits, self.ep_group)
            perm = _by_expert(by_source)
            rows, per_expert = got[perm], by_source.sum(0).tolist()
            me = dist.get_rank(self.ep_group)
            self.sent_bytes += (sum(send_splits) - send_splits[me] + sum(recv_splits) - recv_splits[me]) \
                * xs.shape[1] * xs.element_size()
        else:
            rows, per_expert = xs, counts.tolist()
        if self.tp > 1:
            rows = _IntoTP.apply(rows, self.tp_group)
        ys = expert_mlp(rows, per_expert, _local(module.w_gate), _local(module.w_up), _local(module.w_down),
                        module.act)
        if self.tp > 1:
            ys = _OutOfTP.apply(ys, self.tp_group)
        if ep == 1:
            return ys
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=perm.device)
        return funcol.all_to_all_single_autograd(ys[back].contiguous(), send_splits, recv_splits, self.ep_group)


def _by_expert(by_source: torch.Tensor) -> torch.Tensor:
    """The permutation taking received rows (grouped by source rank, then local expert) to rows
    grouped by local expert, then source rank."""
    sizes = by_source.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    ep, n = by_source.shape
    parts = [torch.arange(int(starts[j * n + e]), int(starts[j * n + e] + sizes[j * n + e]), device=sizes.device)
             for e in range(n) for j in range(ep)]
    return torch.cat(parts) if parts else sizes.new_empty(0)


def moe_blocks(stack: UnitStack) -> list[MoE]:
    return [u.ffn for u in stack.units.values() if isinstance(u, Block) and isinstance(u.ffn, MoE)]


def apply_ep(stack: UnitStack, mesh) -> None:
    """Split each MoE block's experts over the mesh's "ep" dim (if any) and their rows over "tp"
    (if > 1), and install the dispatch. Built on the meta device: only the layout is decided."""
    blocks = moe_blocks(stack)
    stack.ep, stack.ep_sync = 1, None
    names = mesh.mesh_dim_names
    ep = mesh["ep"].size() if "ep" in names else 1
    tp = mesh["tp"].size()
    if not blocks or (ep == 1 and tp == 1):
        if ep > 1:
            raise GeotrainError(f"ep={ep}: the model has no experts to split")
        return
    spec = stack.spec
    if spec.experts % ep:
        raise GeotrainError(f"ep={ep} does not divide the model's {spec.experts} experts")
    if spec.expert_ffn % tp:
        raise GeotrainError(f"tp={tp} does not divide the experts' intermediate size {spec.expert_ffn}")
    sub = mesh["ep", "tp"] if ep > 1 else mesh["tp"]
    ep_group = mesh["ep"].get_group() if ep > 1 else None
    tp_group = mesh["tp"].get_group() if tp > 1 else None
    sync = mesh["dp_rep"].get_group() if ep > 1 and mesh["dp_rep"].size() > 1 else None
    for moe in blocks:
        experts = moe.experts
        for name, rows in _ROWS_DIM.items():
            p = getattr(experts, name)
            placements = [Shard(0), Shard(rows)] if ep > 1 else [Shard(rows)]
            experts.register_parameter(name, nn.Parameter(distribute_tensor(p.data, sub, placements,
                                                                            src_data_rank=None)))
        moe.dispatch = ExpertDispatch(spec.experts, ep_group, ep, tp_group, tp)
    stack.ep, stack.ep_sync = ep, sync       # read by `split_expert_params` (the DP reduction)


def split_expert_params(stack: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the chunk's other parameters, its EP-split experts'); no experts without ep > 1."""
    if getattr(stack, "ep", 1) == 1:
        return list(stack.parameters()), []
    dense, experts = [], []
    for name, p in stack.named_parameters():
        (experts if ".ffn.experts." in name else dense).append(p)
    return dense, experts


def reduce_expert_grads(stack: nn.Module, params: list[nn.Parameter], dp: int) -> None:
    """Replicated DP of EP-split experts: each gradient summed over the replicas holding the same
    experts (`stack.ep_sync`, none when ep = dp) and divided by the whole dp (it already sums its
    EP group's tokens). Dense parameters average over the stage's whole DP group as before; under
    zero2/zero3 FSDP2 leaves the split experts alone (they are already 1/ep per GPU)."""
    for p in params:
        if p.grad is None:
            continue
        g = _local(p.grad)
        if stack.ep_sync is not None:
            dist.all_reduce(g, group=stack.ep_sync)
        g.div_(dp)
