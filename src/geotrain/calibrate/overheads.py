"""The runtime's own costs beyond the model's units, measured on one real rank.

`measure_interpreter` trains for a few steps in this process (pp=1, dp=1, a process group of one)
through `runtime.rank_run.run_rank` itself and reads its trace: the time an iteration's events do not
account for is the interpreter's, per action; a stage call's time beyond its units' is the call
overhead (costs.py adds both to the simulation).
"""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist

from geotrain.calibrate.timers import low_percentile
from geotrain.layout.plan import StagePlan
from geotrain.planner.manual import plan_from_job
from geotrain.runtime.launch import free_port
from geotrain.runtime.rank_run import run_rank
from geotrain.runtime.train_config import RunCase, TrainConfig
from geotrain.spec.load import load_spec


def measure_interpreter(spec_path: str, micro_batch: int, num_microbatches: int, steps: int = 4) -> dict[str, float]:
    """Run the real runtime on one rank (pp=1, dp=1) and read its measured trace: the time in an
    iteration window that no event accounts for, per action, is the interpreter's own cost; the
    recorded forward/backward of the whole model minus the sum of its isolated units' times is the
    cost of one stage call beyond its units (returned per call, so costs.py can add it)."""
    spec = load_spec(spec_path)
    base = plan_from_job(spec)
    plan = base.with_(stages=(StagePlan(dc=base.stages[0].dc, chunks=((0, spec.model.num_units),)),), dp=1,
                      micro_batch=micro_batch, num_microbatches=num_microbatches, schedule="1f1b",
                      sharding="replicate", links=(), extra_warmup=(), pipeline_offsets=(), name="profile-1rank")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            cfg = TrainConfig(out=tmp, steps=steps, progress=False, data="synthetic", checkpoint_every=0)
            trace = run_rank(RunCase(spec, plan, cfg))["trace"]     # the merged trace, in memory
        finally:
            dist.destroy_process_group()
    gaps, fwd, bwd = [], [], []
    actions_per_iteration = 2 * num_microbatches + 2      # F and B per micro-batch, all-reduce, optimizer
    for it in range(2, steps + 1):                        # iteration 1 warms up
        evs = [e for e in trace.events if e.iteration == it]
        comp = [e for e in evs if e.kind in ("forward", "backward", "optimizer")]
        w0, w1 = min(e.start for e in comp), max(e.end for e in comp)
        # Every recorded event (the loss/overflow all-reduce is a recv_wait) is accounted for;
        # what is left is the interpreter's own time between actions.
        gaps.append((w1 - w0 - sum(e.duration for e in evs if e.start >= w0 and e.end <= w1))
                    / actions_per_iteration)
        fwd += [e.duration for e in evs if e.kind == "forward"]
        bwd += [e.duration for e in evs if e.kind == "backward"]
    return {"per_action_s": max(0.0, low_percentile(gaps)), "stage_forward_s": low_percentile(fwd),
            "stage_backward_s": low_percentile(bwd)}
