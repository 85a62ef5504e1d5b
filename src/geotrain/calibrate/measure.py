"""`measure_profile`: the whole `geotrain profile`, in order -- single-process timings first (nothing
else competes for the cores while they run), then the process pool, then the calibration run.
The file format is `calibrate.profile_file`'s."""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict
from typing import Any

import torch

from geotrain.calibrate.calibration_run import calibration_run
from geotrain.calibrate.overheads import measure_interpreter
from geotrain.calibrate.pool import run_pool
from geotrain.calibrate.profile_file import RUNTIME_KEY, MeasuredProfile, as_dict
from geotrain.calibrate.timers import fit_line, measure_startup, measure_units, time_optimizer, time_split_backward
from geotrain.costs import CostModel
from geotrain.costs.memory import optimizer_step_bytes_per_param
from geotrain.planner.manual import plan_from_job


def measure_profile(spec, *, quick: bool = False, micro_batches: list[int] | None = None,
                    precision: str | None = None, progress=None, mode: str | None = None) -> dict[str, Any]:
    """Measure a profile for `spec` (a loaded Spec) on this machine. quick: fewer repeats, dp=2 only.
    mode: the runtime WAN mode of the calibration run (default wanrun.DEFAULT_MODE); calibrate with the
    mode the predicted runs will use."""
    say = progress or (lambda msg: None)
    torch.set_num_threads(1)
    m, job = spec.model, spec.job
    plan = plan_from_job(spec)
    precision = precision or plan.precision
    mbs = sorted(set(micro_batches or [plan.micro_batch]))
    reps = 20 if quick else 40
    say("units")
    prof: dict[str, Any] = measure_units(m, mbs, precision, repeats=reps)

    split = time_split_backward(m, mbs[0], precision, repeats=10 if quick else 20)
    say("optimizer")
    sizes = [range(1, 2), range(1, min(m.layers, 3) + 1), range(0, m.num_units)]
    opt = [time_optimizer(m, u, job) for u in sizes]
    fixed, per_param = fit_line([p for p, _ in opt], [t for _, t in opt])
    step_bytes = optimizer_step_bytes_per_param(precision, job.optimizer)
    prof["memory_bytes_per_s"] = step_bytes / per_param if per_param > 0 else 1e12

    say("interpreter")
    spec_path = str(spec.path)
    interp = measure_interpreter(spec_path, mbs[0], max(2, plan.num_microbatches))
    units_fwd = prof["embedding"][str(mbs[0])][0] + m.layers * prof["block"][str(mbs[0])][0] + \
        prof["head"][str(mbs[0])][0]
    units_bwd = prof["embedding"][str(mbs[0])][1] + m.layers * prof["block"][str(mbs[0])][1] + \
        prof["head"][str(mbs[0])][1]

    cost = CostModel(m, precision=precision, checkpointing="none", optimizer=job.optimizer)
    stage_grad = cost.grad_bytes(plan.stages[0].units)
    grad_fp32 = stage_grad * 4 // cost.dtype_bytes            # fp32 size: the fit's sizes span both dtypes
    boundary = cost.boundary_bytes(mbs[0])                    # boundary tensors travel in the training dtype
    link = next(iter(spec.cluster.wan_links), None)
    world = 4 if not quick else 2
    task = {"model": asdict(m.shape), "micro_batch": mbs[0], "precision": precision,
            "contention_s": 0.5 if quick else 0.8, "dp_sizes": [2] if quick else [2, 4],
            "allreduce_bytes": sorted({4096, grad_fp32 // 4, grad_fp32, 4 * grad_fp32}),
            "p2p_bytes": sorted({4096, boundary, 8 * boundary}), "boundary_bytes": boundary,
            "wan": None if link is None else {
                "per_connection_gbps": link.per_connection_gbps, "aggregate_gbps": link.capacity_gbps,
                "latency_ms": link.latency_ms, "connections": [1, 2, 4], "seconds": 0.15 if quick else 0.3}}
    say(f"{world} processes: contention, all-reduce, p2p, WAN")
    pool, background = run_pool(world, task)
    contention = {k: statistics.mean(r["contention"][k] for r in pool[:int(k)]) for k in pool[0]["contention"]}
    base = contention["1"]
    allreduce = {}
    for n, rows in pool[0]["allreduce"].items():
        a, b = fit_line([x for x, _ in rows], [y for _, y in rows])
        allreduce[n] = {"alpha_s": a, "per_byte_s": b}
    p2a, p2b = fit_line([x for x, _ in pool[0]["p2p"]], [y for _, y in pool[0]["p2p"]])
    runtime: dict[str, Any] = {
        "precision": precision, "threads": 1, "cores": os.cpu_count() or 1, "model": m.name,
        "micro_batches": mbs, "optimizer": {"fixed_s": fixed, "per_param_s": per_param},
        "allreduce": allreduce, "p2p": {"alpha_s": p2a, "per_byte_s": p2b},
        "contention": {k: v / base for k, v in contention.items()},
        "background_runnable": background,
        "per_action_s": interp["per_action_s"],
        "forward_call_s": interp["stage_forward_s"] - units_fwd,
        "backward_call_s": interp["stage_backward_s"] - units_bwd,
        "split_backward": split,
    }
    if link is not None and "wan" in pool[1]:
        runtime["wan"] = {**{k: task["wan"][k] for k in ("per_connection_gbps", "aggregate_gbps", "latency_ms")},
                          "achieved_gbps": pool[1]["wan"]}
        runtime["wan_messages"] = pool[1]["wan_messages"]
    say("calibration run (2-stage pipeline, real runtime)")
    runtime["compute_factor"], runtime["wan_message_overhead_s"], runtime["calibration_run"] = \
        calibration_run(spec, {**prof, RUNTIME_KEY: runtime}, mode=mode)
    say("process start-up")
    runtime["startup_s"] = measure_startup(1)
    prof[RUNTIME_KEY] = runtime
    return prof


def recalibrate(spec, profile: MeasuredProfile | dict[str, Any], mode: str) -> dict[str, Any]:
    """The profile with its calibration run redone over WAN `mode` (the unit, pool and interpreter
    timings kept): what the other WAN mode's predictions need, without profiling twice."""
    profile = as_dict(profile)
    runtime = dict(profile[RUNTIME_KEY])
    runtime["compute_factor"], runtime["wan_message_overhead_s"], runtime["calibration_run"] = \
        calibration_run(spec, {**profile, RUNTIME_KEY: runtime}, mode=mode)
    return {**profile, RUNTIME_KEY: runtime}
