"""The single-process reference the distributed runtime tests compare against."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from geotrain.models.llama import build_model
from geotrain.models.moe import aux_loss_scale
from geotrain.runtime.batches import SyntheticTokens
from geotrain.runtime.interpreter import lm_loss
from geotrain.runtime.recipe import lr_at, param_groups
from geotrain.runtime.trainer import make_optimizer
from geotrain.spec.load import load_spec


@functools.cache
def single_process_losses(spec_path: Path, micro_batch: int, m: int, dp: int, steps: int) -> list[float]:
    """One process, whole model, the global batch of every step (dp x m micro-batches of
    `micro_batch` sequences), the job's optimizer."""
    return reference_run(spec_path, micro_batch, m, dp, steps)[0]


@functools.cache
def reference_run(spec_path: Path, micro_batch: int, m: int, dp: int, steps: int):
    """(losses, gradient norms before clipping, {step: held-out loss}) of the textbook loop: the job's
    AdamW over its weight-decay groups, `torch.nn.utils.clip_grad_norm_` to job.grad_clip, the job's
    lr schedule, the held-out loss every job.eval_every steps."""
    return reference_with_model(spec_path, micro_batch, m, dp, steps)[:3]


@functools.cache
def reference_with_model(spec_path: Path, micro_batch: int, m: int, dp: int, steps: int):
    """reference_run's three, then the model's state dict after the last step (the plain names a
    checkpoint's `model` holds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # as the ranks run (and an OpenMP pool on a loaded 2-core box spins: 27x slower)
    try:
        return _reference_run(spec_path, micro_batch, m, dp, steps)
    finally:
        torch.set_num_threads(threads)


def _reference_run(spec_path: Path, micro_batch: int, m: int, dp: int, steps: int):
    spec = load_spec(spec_path)
    job = spec.job
    torch.manual_seed(job.seed)
    model = build_model(spec.model)
    opt = make_optimizer(param_groups([model], job), job)
    src = SyntheticTokens(spec.model.vocab, spec.model.seq_len, micro_batch, m, dp, job.seed)
    losses, norms, evals = [], [], {}
    for step in range(steps):
        if spec.model.experts:     # MoE: the load-balancing loss is per micro-batch, as the ranks run them
            loss = torch.zeros(())
            for r in range(dp):
                for j in range(m):
                    x, y = src.batch(step, r, j)
                    with aux_loss_scale(1 / (dp * m)):
                        part = lm_loss(model(x), y) / (dp * m)
                    part.backward()
                    loss += part.detach()
        else:
            x, y = src.global_batch(step)
            loss = lm_loss(model(x), y)
            loss.backward()
        if job.grad_clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), job.grad_clip)))
        for group in opt.param_groups:
            group["lr"] = lr_at(step + 1, job)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if job.eval_every and ((step + 1) % job.eval_every == 0 or step + 1 == steps):
            with torch.no_grad():
                evals[step + 1] = sum(lm_loss(model(x), y).item() for x, y in map(src.eval_batch, range(
                    job.eval_batches))) / job.eval_batches
    return losses, norms, evals, model.state_dict()
