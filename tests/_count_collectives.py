"""A rank that counts collectives per case: `python _count_collectives.py CONFIG.json OUT.json`.

Wraps torch.distributed's collectives and runs the cases through the runtime's own worker
(`run_cases`). Per case it records the calls whose group spans the whole world ("world") and the
bytes of gradient reductions in smaller groups ("reduce_bytes": all_reduce tensors and
reduce_scatter inputs of more than one element -- the DP gradient synchronisation)."""

from __future__ import annotations

import inspect
import json
import sys

import torch.distributed as dist

from geotrain.runtime import worker
from geotrain.runtime.trainer import RunConfig

NAMES = ["all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
         "all_to_all_single", "reduce", "gather", "scatter",
         "all_gather_single", "reduce_scatter_single"]     # what FSDP2 calls in newer torch
REDUCTIONS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single")
counts: list[dict] = []


def _wrap(name):
    inner = getattr(dist, name)
    sig = inspect.signature(inner)

    def counted(*args, **kw):
        bound = sig.bind_partial(*args, **kw).arguments
        group = bound.get("group")
        if counts and (group is None or dist.get_world_size(group) == dist.get_world_size()):
            counts[-1]["world"] += 1
        elif counts and name in REDUCTIONS:
            t = bound.get("tensor", bound.get("input"))
            if t is not None and t.numel() > 1:
                counts[-1]["reduce_bytes"] += t.numel() * t.element_size()
        return inner(*args, **kw)

    setattr(dist, name, counted)


for n in NAMES:
    if hasattr(dist, n):
        _wrap(n)
_train = worker.train


def train(cfg, bubble_hook=None):
    counts.append({"world": 0, "reduce_bytes": 0})
    return _train(cfg, bubble_hook)


worker.train = train
cases = [RunConfig(**c) for c in json.loads(open(sys.argv[1]).read())]
worker.run_cases(cases)
with open(sys.argv[2], "w") as f:
    json.dump(counts, f)
