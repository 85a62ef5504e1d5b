"""The whole model in one process: a `trainer.Runner` without pipeline, ranks or transport.

Each micro-batch's loss is divided by their number and its backward accumulates gradients, so a
step on m micro-batches trains like one on their concatenation; `trainer.Trainer` then steps. The
smallest path through the trainer (examples/train_single.py) and a reference for the pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from geotrain.models.moe import aux_loss_scale
from geotrain.runtime.interpreter import lm_loss

Autocast = Callable[[], contextlib.AbstractContextManager]


class WholeModel:
    def __init__(self, model: nn.Module, autocast: Autocast = contextlib.nullcontext):
        self.model, self.autocast = model, autocast

    def run_iteration(self, batches: dict[int, tuple[torch.Tensor, torch.Tensor]], loss_scale: float = 1.0) -> float:
        """Forward and backward of every micro-batch; the step's mean loss."""
        total = torch.zeros(())
        for inputs, targets in batches.values():
            with self.autocast(), aux_loss_scale(loss_scale / len(batches)):
                logits = self.model(inputs)
            loss = lm_loss(logits, targets) / len(batches)
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
            total = total.to(loss.device) + loss.detach()
        return float(total)

    @torch.no_grad()
    def evaluate(self, batches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The mean loss of `batches`, forward only."""
        total = 0.0
        for inputs, targets in batches.values():
            with self.autocast():
                logits = self.model(inputs)
            total += float(lm_loss(logits, targets)) / len(batches)
        return total
