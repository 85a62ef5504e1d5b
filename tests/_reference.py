"""The single-process reference the distributed runtime tests compare against."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from geotrain.models.llama import build_model
from geotrain.runtime.batches import SyntheticTokens
from geotrain.runtime.interpreter import lm_loss
from geotrain.runtime.trainer import make_optimizer
from geotrain.spec.load import load_spec


@functools.cache
def single_process_losses(spec_path: Path, micro_batch: int, m: int, dp: int, steps: int) -> list[float]:
    """One process, whole model, the global batch of every step (dp x m micro-batches of
    `micro_batch` sequences), the job's optimizer."""
    spec = load_spec(spec_path)
    torch.manual_seed(spec.job.seed)
    model = build_model(spec.model)
    opt = make_optimizer(list(model.parameters()), spec.job)
    src = SyntheticTokens(spec.model.vocab, spec.model.seq_len, micro_batch, m, dp, spec.job.seed)
    out = []
    for step in range(steps):
        x, y = src.global_batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out
