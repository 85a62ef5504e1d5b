"""A rank that counts collectives per case: `python _count_collectives.py CONFIG.json OUT.json`
(and its start-up work: schedule builds, and its own run's files read back in the same process).

Wraps torch.distributed's collectives and runs the cases through the runtime's own worker
(`run_cases`). Per case it records the calls whose group spans the whole world ("world") and the
bytes of gradient reductions in smaller groups ("reduce_bytes": all_reduce tensors and
reduce_scatter inputs of more than one element -- the DP gradient synchronisation)."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import torch.distributed as dist

import geotrain.schedule.builders as builders

counts: list[dict] = []
_build = builders.schedule_for_plan


def _counted_build(plan):
    if counts:
        counts[-1]["schedules"] += 1
    return _build(plan)


builders.schedule_for_plan = _counted_build   # before the runtime imports it by name

from geotrain.runtime import worker  # noqa: E402 -- after the wrap above
from geotrain.runtime.runfile import read_run_config  # noqa: E402

NAMES = ["all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
         "all_to_all_single", "reduce", "gather", "scatter",
         "all_gather_single", "reduce_scatter_single"]     # what FSDP2 calls in newer torch
REDUCTIONS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single")


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
_run_rank = worker.run_rank
_reads = {name: getattr(Path, name) for name in ("read_bytes", "read_text")}
out_dir: list[Path] = []


def _wrap_read(name):
    def read(self, *args, **kw):
        if counts and out_dir and Path(self).resolve().is_relative_to(out_dir[-1]):
            counts[-1]["read_back"].append(str(Path(self).relative_to(out_dir[-1])))
        return _reads[name](self, *args, **kw)

    setattr(Path, name, read)


for n in _reads:
    _wrap_read(n)


def run_rank(case, *args):
    """Per case: world collectives, reduction bytes, schedule builds, files of its own run read back."""
    counts.append({"world": 0, "reduce_bytes": 0, "schedules": 0, "read_back": []})
    out_dir.append(Path(case.config.out).resolve())
    return _run_rank(case, *args)


worker.run_rank = run_rank
worker.run_cases(read_run_config(Path(sys.argv[1])))
with open(sys.argv[2], "w") as f:
    json.dump(counts, f)
