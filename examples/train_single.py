"""The smallest runnable path: one process trains the tiny Llama with geotrain's own model and Trainer.

    python examples/train_single.py --steps 20

No planner, no ranks, no launcher: the same `models.llama` model, the job's recipe (AdamW over its
weight-decay groups, lr schedule, clipping) and `runtime.trainer.Trainer` (the step a pipeline rank
takes) over `WholeModel`, which runs the whole model's micro-batches in this process. Everything else
in geotrain is about splitting this loop across GPUs and datacenters.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from geotrain.models.llama import build_model
from geotrain.runtime.batches import SyntheticTokens
from geotrain.runtime.recipe import param_groups
from geotrain.runtime.trainer import Trainer, make_optimizer
from geotrain.runtime.whole_model import WholeModel
from geotrain.spec import load_spec

SPEC = Path(__file__).with_name("tiny_2dc.toml")      # its model and [job]; its cluster is not used here


def train(steps: int = 10, micro_batches: int = 4, micro_batch: int = 2) -> list[float]:
    spec = load_spec(SPEC)
    torch.manual_seed(spec.job.seed)
    model = build_model(spec.model)                                # the plain model, no parallelism applied
    optimizer = make_optimizer(param_groups([model], spec.job), spec.job)
    trainer = Trainer(WholeModel(model), list(model.parameters()), optimizer, job=spec.job)
    data = SyntheticTokens(spec.model.vocab, spec.model.seq_len, micro_batch, micro_batches, dp=1, seed=spec.job.seed)
    losses = []
    for step in range(1, steps + 1):
        batches = {j: data.batch(step - 1, 0, j) for j in range(micro_batches)}   # micro-batch -> (inputs, targets)
        losses.append(trainer.step(step, batches).loss)
        print(f"step {step:3d}  loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    train(p.parse_args().steps)
