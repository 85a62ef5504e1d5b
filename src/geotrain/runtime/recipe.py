"""The training recipe around a step: learning-rate schedule, weight-decay groups, global gradient clipping.

`lr_at(step, job)` is a pure function of the (1-based) optimizer step and the job -- warm-up, then
cosine / linear / WSD / constant decay to `job.final_lr` at `job.steps` -- so a resumed, resharded
or elastic run continues the same curve. `param_groups` decays weight matrices only (embeddings,
norms and biases when the job says so); a tied head counts as the embedding it is. `GradNorm`
gives the norm of the WHOLE model's gradient from every rank's local pieces: each rank sums the
squares of what it holds, weighted by the share of the stage's ranks holding the same values (a
DTensor's sharded mesh dims hold distinct pieces; Replicate dims, DP replicas and TP copies of plain
tensors are the same numbers), so the sum over a stage's ranks is that stage's sum of squares
counted once. Inside the stage one all-reduce (inside a DC) gives the stage's sum; across the
stages the sums travel down the pipeline to stage 0 and the total back up (`GradNorm`), posted
as soon as this stage's gradients are final, before the rank waits for its boundary sends' ACKs. fp16 folds
the partial into the overflow all-reduce the step already runs (`trainer.StepGroup`). Clipping
then scales every gradient by min(1, max_norm / (norm + 1e-6)), as `clip_grad_norm_` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from geotrain.runtime.meshes import reused_groups
from geotrain.runtime.scaler import _local

NORM_TAG = 1 << 30  # the gradient norm's p2p tags (+0 partial sums, +1 the total): above every p2p.make_tag


def lr_at(step: int, job, horizon: int | None = None) -> float:
    """The learning rate of optimizer step `step` (1-based) of `job`; the decay ends at `horizon`
    (default job.steps) and stays at job.final_lr after it."""
    horizon = job.steps if horizon is None else horizon
    peak, final, warm = job.lr, job.final_lr, job.warmup_steps
    if step <= warm:
        return peak * step / warm
    if job.decay == "constant":
        return peak
    p = min(1.0, (step - warm) / max(1, horizon - warm))
    if job.decay == "cosine":
        return final + (peak - final) * 0.5 * (1.0 + math.cos(math.pi * p))
    if job.decay == "wsd":
        stable = 1.0 - job.wsd_decay_fraction
        p = 0.0 if p <= stable else (p - stable) / job.wsd_decay_fraction
    return peak - (peak - final) * p


def _kind(module: nn.Module, name: str, p: nn.Parameter, embeddings: set[int]) -> str:
    if id(p) in embeddings or isinstance(module, nn.Embedding):
        return "embeddings"
    if "norm" in type(module).__name__.lower():
        return "norms"
    if name == "bias":
        return "biases"
    return "matrices" if p.dim() >= 2 else "norms"


def param_groups(modules: Iterable[nn.Module], job, embeddings: Iterable[nn.Parameter] = ()) -> list[dict]:
    """The optimizer's parameter groups: weight decay on matrices (and embeddings / norms / biases
    where the job says), none elsewhere; DTensors apart from plain tensors (foreach kernels refuse a
    mix). `embeddings`: more parameters that are embeddings (a tied head's copy)."""
    decayed = {"matrices"} | {k for k in ("embeddings", "norms", "biases") if getattr(job, f"weight_decay_{k}")}
    emb = {id(p) for p in embeddings}
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    seen: set[int] = set()
    for module in modules:
        for sub in module.modules():
            for name, p in sub.named_parameters(recurse=False):
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                key = (_kind(sub, name, p, emb) in decayed, isinstance(p, DTensor))
                groups.setdefault(key, []).append(p)
    return [{"params": ps, "weight_decay": job.weight_decay if decay else 0.0}
            for (decay, _), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _distinct_pieces(t: torch.Tensor) -> int:
    """How many different pieces of a parameter exist over its mesh (1 for a plain tensor)."""
    if not isinstance(t, DTensor):
        return 1
    n = 1
    for dim, placement in enumerate(t.placements):
        if not placement.is_replicate():        # Shard, and FSDP2 + TP's _StridedShard (not a Shard)
            n *= t.device_mesh.size(dim)
    return n


def local_sq_sum(params: Iterable[nn.Parameter], stage_ranks: int, device: torch.device,
                 skip: Iterable[nn.Parameter] = ()) -> torch.Tensor:
    """This rank's weighted sum of squared gradients (fp64): summed over a stage's `stage_ranks`
    ranks it is the stage's sum of squares, each value counted once. `skip`: copies counted
    elsewhere (a tied head's, counted with the embedding)."""
    skipped = {id(p) for p in skip}
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None or id(p) in skipped:
            continue
        g = _local(p.grad)
        if g.numel():
            w = _distinct_pieces(p.grad) / stage_ranks
            total += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 * w
    return total


@torch.no_grad()
def clip_(params: Iterable[nn.Parameter], norm: float, max_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)) (clip_grad_norm_'s rule)."""
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                _local(p.grad).mul_(coef)


class GradNorm:
    """The global gradient norm on one rank of a plan (see the module docstring). Construct on
    every rank, in the same order: it creates each stage's process group.

    The stages' sums travel along the pipeline, the way its gradients do: stage s adds its own to
    what stage s+1 sent and passes it on to s-1 (the last stage starts, as soon as its gradients
    are final); stage 0 then holds the whole sum, and sends it back up the chain, stage by stage,
    the way the next iteration's activations go. Every message is one float64 between neighbours
    -- the links the plan already uses -- and stage 0, the last to finish a 1F1B iteration, finds
    the sum waiting; the others get the total about when they would get stage 0's next activations.
    The scalars travel as CPU tensors (gloo): ranks sharing one GPU could not exchange them over
    NCCL, and the host needs the norm anyway; each cross-stage wait is bounded by the outage limit
    and names its peer. A gloo send leaves only once its receiver has posted the receive (the
    receiver's notice crosses the link first), so `post` puts both receives up before the step's
    iteration: a receive posted when the stage is done would cost a WAN round trip, not a one-way
    trip, on stage 0's critical path."""

    def __init__(self, plan, rank: int, device: torch.device, limit_s: float = 300.0):
        stage, replica, t = plan.coords(rank)
        self.limit_s = limit_s           # the outage limit: how long a cross-stage wait may last
        self.dc_of_rank = plan.dc_of_rank   # a stalled peer is named with its DC, as the p2p waits name it
        self.device, self.stage_ranks, self.stage, self.pp = device, plan.dp * plan.stage_tp(stage), stage, plan.pp
        per_stage = [sorted(plan.stage_ranks(s)) for s in range(plan.pp)]
        groups = iter(reused_groups("grad_norm", [ranks for ranks in per_stage if len(ranks) > 1]))
        self.stage_group = None
        for s, ranks in enumerate(per_stage):
            group = next(groups) if len(ranks) > 1 else None
            if s == stage:
                self.stage_group = group
        tp = plan.stage_tp(stage)

        def source(s: int) -> int | None:       # the rank of stage s this one hears from
            return plan.rank(s, replica, t % plan.stage_tp(s)) if 0 <= s < plan.pp else None

        def targets(s: int) -> list[int]:       # the ranks of stage s this one tells (each hears once)
            if not 0 <= s < plan.pp:
                return []
            return [plan.rank(s, replica, u) for u in range(plan.stage_tp(s)) if u % tp == t]

        self.from_up, self.to_down = source(stage + 1), targets(stage - 1)      # the partial sums
        self.from_down, self.to_up = source(stage - 1), targets(stage + 1)      # the total
        self._posted = None

    def _wait(self, work, peer: int | None) -> None:
        limit = self.limit_s
        try:
            work.wait(timeout=timedelta(seconds=limit))
        except RuntimeError as e:
            where = f" ({self.dc_of_rank(peer)})" if peer is not None else ""
            raise RuntimeError(f"gradient norm exchange with rank {peer}{where}: no answer within {limit:.0f} s "
                               f"(--outage-limit; did a peer rank stop?) [{str(e).strip()[:120]}]") from None

    def post(self) -> None:
        """Post this step's receives (the partial sum from the next stage, the total from the
        previous one) before the step's iteration runs, so each arrives one latency after it is sent."""
        def recv(peer: int | None, tag: int):
            if peer is None:
                return None
            buf = torch.empty(1, dtype=torch.float64)
            return buf, dist.irecv(buf, peer, tag=tag)
        self._posted = recv(self.from_up, NORM_TAG), recv(self.from_down, NORM_TAG + 1)

    def start(self, local: torch.Tensor):
        """Sum `local_sq_sum` over the stage (inside its DC), add the partial sum of the stages after
        this one and pass it on towards stage 0, without waiting for it to leave."""
        if self._posted is None:
            self.post()
        (up, total), self._posted = self._posted, None
        acc = local.detach().reshape(1).to("cpu", torch.float64)
        if self.stage_group is not None:
            dist.all_reduce(acc, group=self.stage_group)
        if up is not None:
            self._wait(up[1], self.from_up)
            acc = up[0] + acc              # later stages first: the same order of additions everywhere
        works = [(dist.isend(acc, peer, tag=NORM_TAG), peer) for peer in self.to_down]
        if total is None:
            return acc, works
        return total[0], works + [(total[1], self.from_down)]

    def finish(self, pending) -> float:
        """The norm over every stage: stage 0's sum, passed on up the chain."""
        total, works = pending
        for work, peer in works:
            self._wait(work, peer)
        for work, peer in [(dist.isend(total, peer, tag=NORM_TAG + 1), peer) for peer in self.to_up]:
            self._wait(work, peer)
        return math.sqrt(float(total))

    def total(self, local: torch.Tensor) -> float:
        return self.finish(self.start(local))
