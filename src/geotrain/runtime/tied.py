"""Tied embeddings (one matrix for the embedding and the output head) across a pipeline.

When one chunk holds both ends (pp=1) they are one Parameter (`UnitStack.tie_head_to_embedding`,
at build) and nothing more is needed. In a pipeline the first stage holds the embedding and the
last the head: each keeps a copy, and before every optimizer step the two copies' gradients are
summed in a process group of the first- and last-stage rank of each DP replica (and TP index),
Megatron's embedding group. Both copies start equal (the same init or checkpoint tensor), get
the same summed gradient and take the same optimizer step, so they stay bit-equal -- and equal to
the one matrix a pp=1 run trains. Under FSDP2 each rank sums its shard with the same rows of the
other stage's copy (same shape, same dp: same layout).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from geotrain.runtime.meshes import reused_groups
from geotrain.runtime.scaler import _local
from geotrain.runtime.shared_gpu import all_reduce_staged

EMBEDDING = "units.0.tok.weight"


def head_name(model) -> str:
    return f"units.{model.num_units - 1}.out.weight"


class TiedCopies:
    """This rank's copies of a tied matrix, and the group that keeps them equal. Every rank must
    construct it (creating process groups is collective), tied or not, in the same order."""

    def __init__(self, plan, model, rank: int, chunks: dict[int, nn.Module], staged: bool = False):
        self.group: dist.ProcessGroup | None = None
        self.staged = staged            # the two copies' ranks share a GPU: sum through host memory (shared_gpu)
        self.params: list[nn.Parameter] = []
        self.head_copy: list[nn.Parameter] = []
        if not getattr(model, "tie_embeddings", False):
            return
        if plan.pp > 1:
            pairs = [[plan.rank(0, replica, t), plan.rank(plan.pp - 1, replica, t)]
                     for replica in range(plan.dp) for t in range(plan.tp)]
            for ranks, group in zip(pairs, reused_groups("tied", pairs)):
                if rank in ranks:
                    self.group = group
            first, last = plan.stages[0].dc, plan.stages[-1].dc
            if first != last and rank == plan.rank(0, 0, 0):
                # Said at start, like every link's transport: this sum is not carried by the WAN
                # transport (no striping, no turns); the planner and simulator price it as such
                # (costs.comm.tied_sum_time: one connection per pair).
                print(f"geotrain wan: tied embeddings: stage 0 ({first}) <-> stage {plan.pp - 1} ({last}): "
                      f"gradient sum by plain {dist.get_backend()} all-reduce across the WAN every step "
                      "(one connection per pair, not striped; priced so by the planner and simulator)", flush=True)
        head = head_name(model)
        held = [(n, p) for chunk in chunks.values() for n, p in chunk.named_parameters() if n in (EMBEDDING, head)]
        self.params = [p for _, p in held]
        # The head's copy where this rank holds it apart from the embedding (a pipeline's last
        # stage): the gradient norm counts the matrix once, with the embedding. A chunk holding both
        # ends has one Parameter, listed once, by the embedding's name.
        self.head_copy = [p for n, p in held if n == head]

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Sum the copies' gradients (after the DP reduction, before the optimizer step)."""
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        if len(grads) == 2:          # both copies on this rank (separate chunks): sum them here
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        if self.group is not None and grads:
            all_reduce_staged(grads[0], self.group, self.staged)
            for g in grads[1:]:
                g.copy_(grads[0])
