"""The training step: run the rank's schedule, then the optimizer step it ends with.

`Trainer.step` is one optimizer step, in this order: run the action list (the interpreter
returns at its end -- the OPTIMIZER action is always last -- with this rank's loss sum), sum
tied embeddings' gradients, decide fp16 overflow (every rank skips the same steps), step the
optimizer, zero the gradients, update the loss scale, reduce the loss. The recipe's part
(`recipe`): the global gradient norm (folded into fp16's overflow all-reduce, else `GradNorm`'s
exchange), clipping to `job.grad_clip`, and the step's learning rate `lr_at(step, job)`.

A `runner` is what runs the forward and backward passes of one step: the pipeline interpreter
(`interpreter.PipelineRank`) on a rank, or `whole_model.WholeModel` in one process. A `StepGroup`
says how the ranks agree on a step; without one (one process) nothing is reduced.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from geotrain.runtime.recipe import GradNorm, clip_, local_sq_sum, lr_at, set_lr
from geotrain.runtime.recorder import Recorder
from geotrain.runtime.scaler import GlobalLossScaler, _local
from geotrain.runtime.tied import TiedCopies

Batches = dict[int, tuple[torch.Tensor, torch.Tensor]]     # micro-batch -> (inputs, targets)


class Runner(Protocol):
    def run_iteration(self, batches: Batches, loss_scale: float = 1.0) -> float:
        """Forward and backward of every micro-batch; this rank's share of the loss (0.0 if it holds none)."""

    def evaluate(self, batches: Batches) -> float:
        """Forward only; this rank's share of the loss, as run_iteration's."""


def make_optimizer(params, job, sharding: str = "replicate",
                   dp_group: dist.ProcessGroup | None = None) -> torch.optim.Optimizer:
    """The job's optimizer (betas, eps, weight decay) over `params`: tensors, or the param groups of
    `recipe.param_groups` (decay on matrices only; a plain list decays every tensor). ZeRO-1
    partitions its state over the stage's DP group."""
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[job.optimizer]
    kw = {"lr": job.lr, "weight_decay": job.weight_decay}
    if job.optimizer != "sgd":
        kw.update(betas=tuple(job.betas), eps=job.eps)
    if sharding == "zero1":
        # lazy: torch.distributed.optim imports FSDP1 and the tensor package (~0.7 s of every rank's
        # start-up) and only ZeRO-1 needs it
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=dp_group, **kw)
    return cls(params, **kw)


def state_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state (local shards only)."""
    def nbytes(t) -> int:
        t = _local(t)
        return t.numel() * t.element_size()

    opt = getattr(optimizer, "optim", optimizer)  # ZeRO-1: the local partition's optimizer
    ostate = sum(nbytes(v) for st in opt.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None), "optimizer": ostate}


@dataclass(frozen=True)
class StepGroup:
    """How the ranks of a plan agree on a step. The loss lives on the last stage: its DP replicas
    sum it inside their group (`dp_group`, `dp` of them). Only fp16 needs the world: one all-reduce
    of the overflow flag, so every rank skips the same steps, with the loss riding along (counted
    `loss_copies` times over the world: every TP rank of the last stage holds the whole loss)."""

    dp_group: dist.ProcessGroup | None
    dp: int
    loss_copies: int
    holds_loss: bool
    device: torch.device

    def overflow(self, found: bool, loss_local: float, sq: float = 0.0) -> tuple[bool, float, float]:
        """(skip, loss, the whole model's squared gradient norm from every rank's `sq`)."""
        stats = torch.tensor([1.0 if found else 0.0, loss_local, sq], dtype=torch.float64)
        dist.all_reduce(stats)
        return bool(stats[0] > 0), float(stats[1]) / self.loss_copies, float(stats[2])

    def loss(self, loss_local: float) -> float | None:
        if not self.holds_loss:
            return None
        t = torch.tensor([loss_local], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return float(t) / self.dp


@dataclass(frozen=True)
class StepResult:
    loss: float | None      # the step's mean loss where known (the last stage; every rank in fp16)
    skipped: bool           # fp16 overflow: no optimizer step was taken
    grad_norm: float | None = None   # the whole model's gradient norm before clipping (clipping on)
    lr: float | None = None          # the learning rate of this step


class Trainer:
    """Owns one rank's training step: the runner, the optimizer and its parameters, the loss scaler."""

    def __init__(self, runner: Runner, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 scaler: GlobalLossScaler | None = None, *, tied: TiedCopies | None = None,
                 group: StepGroup | None = None, recorder: Recorder | None = None, stage: int = 0,
                 inject_inf: Iterable[int] = (), job=None, norm: GradNorm | None = None,
                 norm_skip: Iterable[torch.nn.Parameter] = ()):
        """`job`: the recipe (lr schedule, grad_clip; None: the optimizer's lr, no clipping); `norm`:
        how ranks agree on the gradient norm (None: one process); `norm_skip`: copies counted
        elsewhere (the last stage's tied head)."""
        self.runner, self.params, self.optimizer = runner, params, optimizer
        self.job, self.norm, self.norm_skip = job, norm, list(norm_skip)
        self.clip = float(job.grad_clip) if job is not None else 0.0
        self._defer = False
        self.scaler = scaler or GlobalLossScaler(False)
        self.tied, self.group, self.stage = tied, group, stage
        self.recorder = recorder or Recorder(0, 0.0, enabled=False)
        self.inject_inf = set(inject_inf)      # test hook: steps whose first gradient becomes inf
        self.optimizer_steps = 0
        self.memory: dict[str, int] = {}       # state_bytes after the first optimizer step

    def step(self, step: int, batches: Batches) -> StepResult:
        """One optimizer step on `batches` (this rank's micro-batches; {} where it holds neither end)."""
        # With the norm exchange, the boundary sends are waited for after its partial is posted.
        exchange = self.clip > 0 and self.norm is not None and not self.scaler.enabled
        self._defer = exchange and hasattr(self.runner, "finish_sends")
        if exchange:
            self.norm.post()                # its receives up before the iteration (GradNorm's docstring)
        loss_local = self.runner.run_iteration(batches, loss_scale=self.scaler.scale,
                                               **({"wait_sends": False} if self._defer else {}))
        if step in self.inject_inf:
            self._poison_a_gradient()
        if self.tied is not None:
            self.tied.sum_grads()           # tied embeddings: the first and last stage's copies stay equal
        skipped, loss, grad_norm = self._overflow(loss_local)
        rec = self.recorder
        t = rec.mark()
        lr = lr_at(step, self.job) if self.job is not None else None
        if not skipped:
            if self.clip > 0:
                clip_(self.params, grad_norm, self.clip)
            if lr is not None:
                set_lr(self.optimizer, lr)
            self.optimizer.step()
            self.optimizer_steps += 1
            if self.optimizer_steps == 1:
                self.memory = state_bytes(self.params, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update(skipped)
        rec.add("optimizer", t, rec.mark(), stage=self.stage)
        if loss is None:
            loss = self.group.loss(loss_local) if self.group is not None else loss_local
        return StepResult(loss, skipped, grad_norm if self.clip > 0 else None, lr)

    def evaluate(self, batches: Batches) -> float | None:
        """The held-out loss of `batches` (forward only; no gradient, no step), where the loss lives."""
        loss_local = self.runner.evaluate(batches)
        return self.group.loss(loss_local) if self.group is not None else loss_local

    def _sq(self) -> torch.Tensor:
        ranks = self.norm.stage_ranks if self.norm is not None else 1
        device = self.norm.device if self.norm is not None else self.params[0].device
        return local_sq_sum(self.params, ranks, device, self.norm_skip)

    def _overflow(self, loss_local: float) -> tuple[bool, float | None, float | None]:
        """(skip this step, the loss if the decision already reduced it, the gradient norm): fp16 decides
        an overflow and sums the norm in one world-wide all-reduce; else the norm is `GradNorm`'s."""
        if not self.scaler.enabled:
            if self.clip <= 0:
                return False, None, None
            sq = self._sq()
            if self.norm is None:
                return False, None, float(sq) ** 0.5
            t = self.recorder.mark()
            pending = self.norm.start(sq)       # the stage's sum, and the partial of the stages after it
            self.recorder.add("recv_wait", t, self.recorder.mark(), stage=-1)
            if self._defer:
                self.runner.finish_sends()
            t = self.recorder.mark()
            norm = self.norm.finish(pending)
            self.recorder.add("recv_wait", t, self.recorder.mark(), stage=-1)
            return False, None, norm
        rec = self.recorder
        t = rec.mark()
        found = self.scaler.local_found_inf(self.params)     # unscales this rank's gradients
        sq = float(self._sq()) if self.clip > 0 else 0.0
        if self.group is None:
            return found, loss_local, sq ** 0.5
        skipped, loss, total = self.group.overflow(found, loss_local, sq)   # the one world-wide collective
        rec.add("recv_wait", t, rec.mark(), stage=-1)
        return skipped, loss, total ** 0.5

    def _poison_a_gradient(self) -> None:
        g = next(p.grad for p in self.params if p.grad is not None and _local(p.grad).numel())
        _local(g).view(-1)[0] = float("inf")
