"""`geotrain profile`: measure on this machine what the simulator needs, the way the runtime runs it.

The file is the cost model's profile format (geotrain.cost.profile: per-unit-kind forward and
backward seconds per micro-batch, `memory_bytes_per_s`) plus one extra key, "runtime", with what
the cost model has no field for but the calibrated simulation (costs.py) uses:

    "runtime": {
      "precision", "threads", "cores", "model", "micro_batches",
      "optimizer":  {"fixed_s", "per_param_s"},           # one optimizer step of a stage (fit)
      "allreduce":  {"2": {"alpha_s", "per_byte_s"}, ...}, # gloo all-reduce of dp ranks (fit)
      "p2p":        {"alpha_s", "per_byte_s"},             # gloo isend/irecv between two ranks
      "contention": {"1": 1.0, "2": f2, ...},              # compute slow-down when k ranks compute at once
      "background_runnable",                                  # other runnable threads meanwhile (cpuload.py)
      "per_action_s", "forward_call_s", "backward_call_s", # interpreter overheads (see _interpreter)
      "split_backward": {"input", "weight"},              # zero-bubble B_input, W over one backward
      "startup_s",                                         # one rank's process start-up (import torch ...)
      "compute_factor": {"forward", "backward", "optimizer"}, # in-runtime / isolated compute (calibration run)
      "wan_message_overhead_s", "calibration_run",         # per-message WAN overhead, global all-reduce,
                                                           # wan_mode, rank_slowdown, background_effective
      "wan": {"per_connection_gbps", "aggregate_gbps", "latency_ms", "achieved_gbps": {"1": .., "4": ..}}
    }

Why measure this way: each unit is timed as `geotrain.runtime` executes it -- a `UnitStack` of the
unit, fp32 weights under the precision's autocast, one CPU thread, float32 boundary tensors, the
last unit's loss through the runtime's own `lm_loss` -- so the numbers are the runtime's, not a
kernel benchmark's. Multi-process measurements run in one pool of spawned worker processes (one
start-up paid once); the pool is started only after the single-process timings, so nothing else
competes for the cores while those run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUNTIME_KEY = "runtime"


# -- file ------------------------------------------------------------------------------------

def save_profile(profile: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile, indent=1) + "\n")


def load_profile(path: str | Path) -> dict[str, Any]:
    from geotrain.errors import GeotrainError

    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GeotrainError(f"{path}: profile file not found") from None
    except json.JSONDecodeError as e:
        raise GeotrainError(f"{path}: not a JSON profile ({e})") from None
    if not isinstance(doc, dict) or "block" not in doc:
        raise GeotrainError(f"{path}: not a geotrain profile (no 'block' table; make one with `geotrain profile`)")
    return doc


def cost_profile(profile: dict[str, Any]) -> dict[str, Any]:
    """The part `CostModel(profile=...)` accepts (its format has no 'runtime' key)."""
    from geotrain.cost.profile import PROFILE_KEYS

    return {k: v for k, v in profile.items() if k in PROFILE_KEYS}


# -- single-process timings ----------------------------------------------------------------------

def _median_times(fn, repeats: int, warmup: int = 2) -> tuple[float, float]:
    """The 10th percentile of `repeats` timed runs after `warmup`: the machine is shared, and a run
    that another process preempted is slower for a reason the profile must not bake in (the
    calibrated simulation models other work separately, from the measured background load)."""
    fwd, bwd = [], []
    for i in range(repeats + warmup):
        a, b = fn()
        if i >= warmup:
            fwd.append(a)
            bwd.append(b)
    return _low(fwd), _low(bwd)


def _low(xs: list[float]) -> float:
    """The 10th percentile (lower quartile's stricter cousin: robust to most runs being preempted)."""
    xs = sorted(xs)
    return xs[(len(xs) - 1) // 10]


def time_unit(spec, index: int, micro_batch: int, precision: str, repeats: int = 10) -> tuple[float, float]:
    """(forward_s, backward_s) of model unit `index` at `micro_batch`, executed as the runtime does."""
    return _median_times(unit_runner(spec, index, micro_batch, precision), repeats)


def unit_runner(spec, index: int, micro_batch: int, precision: str):
    """A function that runs unit `index` forward and backward once and returns (forward_s, backward_s)."""
    import torch

    from geotrain.models.llama import build_units
    from geotrain.runtime.parallelize import autocast_context
    from geotrain.runtime.pipeline import lm_loss

    m = spec
    stack = build_units(m, index, index + 1)
    autocast = autocast_context(precision, torch.device("cpu"))
    g = torch.Generator().manual_seed(index)
    tokens = torch.randint(0, m.vocab, (micro_batch, m.seq_len), generator=g)
    x0 = torch.randn(micro_batch, m.seq_len, m.hidden, generator=g)
    grad = torch.randn(micro_batch, m.seq_len, m.hidden, generator=g)

    def once() -> tuple[float, float]:
        stack.zero_grad(set_to_none=True)
        inp = tokens if index == 0 else x0.detach().clone().requires_grad_(True)
        t0 = time.perf_counter()
        with autocast():
            out = stack(inp)
        if stack.has_head:
            out = lm_loss(out, tokens)
        t1 = time.perf_counter()
        torch.autograd.backward(out, None if stack.has_head else grad)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    return once


def time_split_backward(spec, micro_batch: int, precision: str, repeats: int = 10) -> dict[str, float]:
    """The zero-bubble split of a backward as the runtime runs it (torch.distributed.pipelining's
    stage_backward_input, then stage_backward_weight) on units 1..L+1 (blocks and head), relative to
    one plain backward of the same units: {"input": B_input / B, "weight": W / B}. The split costs
    more than the whole (two autograd passes), and not half and half."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from geotrain.models.llama import build_units
    from geotrain.runtime.parallelize import autocast_context
    from geotrain.runtime.pipeline import lm_loss

    m = spec
    stack = build_units(m, 1, m.num_units)
    autocast = autocast_context(precision, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.vocab, (micro_batch, m.seq_len), generator=g)
    x0 = torch.randn(micro_batch, m.seq_len, m.hidden, generator=g)

    def once(split: bool) -> tuple[float, float]:
        stack.zero_grad(set_to_none=True)
        inp = x0.detach().clone().requires_grad_(True)
        with autocast():
            out = lm_loss(stack(inp), tokens)
        t0 = time.perf_counter()
        if not split:
            torch.autograd.backward(out)
            return time.perf_counter() - t0, 0.0
        _, groups = stage_backward_input([out], None, [inp], stack.parameters())
        t1 = time.perf_counter()
        stage_backward_weight(stack.parameters(), groups)
        return t1 - t0, time.perf_counter() - t1

    whole, parts = [], []
    for i in range(repeats + 2):            # interleaved: a burst of other work hits both alike
        w, p = once(False)[0], once(True)
        if i >= 2:
            whole.append(w)
            parts.append(p)
    # Per pair ratios, then the median: robust to a pair that another process preempted.
    ins = sorted(a / w for (a, _), w in zip(parts, whole))
    ws = sorted(b / w for (_, b), w in zip(parts, whole))
    return {"input": ins[len(ins) // 2], "weight": ws[len(ws) // 2]}


def time_optimizer(spec, units: range, job, repeats: int = 8) -> tuple[int, float]:
    """(parameters, seconds) of one optimizer step (+ zero_grad) over `units`, as the runtime steps it."""
    import torch

    from geotrain.models.llama import build_units
    from geotrain.runtime.trainer import make_optimizer

    stack = build_units(spec, units.start, units.stop)
    params = list(stack.parameters())
    opt = make_optimizer(params, job)
    times = []
    for i in range(repeats + 2):
        for p in params:
            p.grad = torch.ones_like(p)
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sum(p.numel() for p in params), _low(times)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope), both clamped at >= 0 (a cost never falls with size)."""
    n = len(xs)
    if n == 1 or max(xs) == min(xs):
        return max(0.0, statistics.mean(ys)), 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


def measure_startup(repeats: int = 2) -> float:
    """Seconds for one rank's process to start and import what the runtime worker imports."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import geotrain.runtime.worker"], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        times.append(time.perf_counter() - t0)
    return min(times)


def _interpreter(spec_path: str, micro_batch: int, num_microbatches: int, steps: int = 4) -> dict[str, float]:
    """Run the real runtime on one rank (pp=1, dp=1) and read its measured trace: the time in an
    iteration window that no event accounts for, per action, is the interpreter's own cost; the
    recorded forward/backward of the whole model minus the sum of its isolated units' times is the
    cost of one stage call beyond its units (returned per call, so costs.py can add it)."""
    import tempfile

    import torch.distributed as dist

    from geotrain.config.load import load_spec
    from geotrain.plan.manual import plan_from_job
    from geotrain.plan.plan import StagePlan
    from geotrain.runtime.launch import free_port
    from geotrain.runtime.trainer import RunConfig, train
    from geotrain.trace.schema import Trace

    spec = load_spec(spec_path)
    base = plan_from_job(spec)
    plan = base.with_(stages=(StagePlan(dc=base.stages[0].dc, chunks=((0, spec.model.num_units),)),), dp=1,
                      micro_batch=micro_batch, num_microbatches=num_microbatches, schedule="1f1b",
                      sharding="replicate", links=(), extra_warmup=(), pipeline_offsets=(), name="profile-1rank")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            train(RunConfig(spec=spec_path, out=tmp, plan=plan.to_dict(), steps=steps, progress=False,
                            data="synthetic", checkpoint_every=0))
        finally:
            dist.destroy_process_group()
        trace = Trace.read_jsonl(Path(tmp) / "measured_trace.jsonl")
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
    return {"per_action_s": max(0.0, _low(gaps)), "stage_forward_s": _low(fwd), "stage_backward_s": _low(bwd)}


# -- the pool: contention, collectives, transfers ----------------------------------------------

def pool_worker_main(argv: list[str]) -> int:
    """Entry of one pool process: `python -m geotrain.calibrate.profile TASK.json OUT_DIR` with
    RANK, WORLD_SIZE, MASTER_ADDR/PORT set; writes OUT_DIR/rank<R>.json."""
    import torch
    import torch.distributed as dist

    task = json.loads(Path(argv[0]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out: dict[str, Any] = {}
        out["contention"] = _contention(rank, world, task)
        out["allreduce"] = _allreduce(rank, world, task)
        out["p2p"] = _p2p(rank, task)
        if task.get("wan"):
            out["wan"] = _wan_rates(rank, task["wan"])
            out["wan_messages"] = _wan_messages(rank, task["wan"], task["boundary_bytes"])
        (Path(argv[1]) / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
    return 0


def _contention(rank: int, world: int, task: dict) -> dict[str, float]:
    """Per k = 1..world: median seconds of one block forward+backward while k ranks compute at once."""
    import torch.distributed as dist

    from geotrain.config.model import ModelSpec

    once = unit_runner(ModelSpec(**task["model"]), 1, task["micro_batch"], task["precision"])
    once()
    out = {}
    for k in range(1, world + 1):
        dist.barrier()
        if rank < k:
            t0 = time.perf_counter()
            n = 0
            while time.perf_counter() - t0 < task["contention_s"]:
                once()
                n += 1
            out[str(k)] = (time.perf_counter() - t0) / n
        dist.barrier()
    return out


def _allreduce(rank: int, world: int, task: dict) -> dict[str, list[tuple[int, float]]]:
    import torch
    import torch.distributed as dist

    out: dict[str, list[tuple[int, float]]] = {}
    for n in task["dp_sizes"]:
        if n > world:
            continue
        group = dist.new_group(list(range(n)))
        rows = []
        for nbytes in task["allreduce_bytes"]:
            t = torch.ones(max(1, nbytes // 4))
            times = []
            for i in range(7):
                dist.barrier()
                t0 = time.perf_counter()
                if rank < n:
                    dist.all_reduce(t, group=group)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            rows.append((nbytes, _low(times)))
        out[str(n)] = rows
    return out


def _p2p(rank: int, task: dict) -> list[tuple[int, float]]:
    """One-way isend/irecv time between ranks 0 and 1 (half a ping-pong)."""
    import torch
    import torch.distributed as dist

    rows = []
    for nbytes in task["p2p_bytes"]:
        t = torch.ones(max(1, nbytes // 4))
        times = []
        for i in range(12):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
                dist.send(t, 0)
            if i >= 2:
                times.append((time.perf_counter() - t0) / 2)
        rows.append((nbytes, _low(times)))
    return rows


def _wan_rates(rank: int, wan: dict) -> dict[str, float]:
    """Achieved Gbit/s of one transfer over the user-space WAN with n connections (ranks 0 -> 1)."""
    import torch
    import torch.distributed as dist

    from geotrain.emulation.shaper import ShaperConfig
    from geotrain.runtime.wan import MIN_CHUNK_BYTES
    from geotrain.wan.striped import StripedTransport

    store = dist.distributed_c10d._get_default_store()
    out = {}
    for n in wan["connections"]:
        # The runtime's shaper mode: both caps, exact pacing, 4 KB stripes (runtime.wan.build_transport).
        cfg = ShaperConfig(per_connection_gbps=wan["per_connection_gbps"], aggregate_gbps=wan["aggregate_gbps"],
                           delay_ms=wan["latency_ms"])
        rate = min(n * wan["per_connection_gbps"], wan["aggregate_gbps"])
        nbytes = int(max(256 << 10, rate * 1e9 / 8 * wan["seconds"]))
        tr = StripedTransport(rank, store, connections=n, shaper=cfg, prefix=f"profile/wan{n}",
                              min_chunk_bytes=MIN_CHUNK_BYTES)
        dist.barrier()
        t = torch.ones(nbytes // 4)
        times = []
        for i in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                tr.send(t, 1, tag=i).wait()
            elif rank == 1:
                tr.recv(t, 0, tag=i).wait()
            dt = time.perf_counter() - t0 - wan["latency_ms"] * 1e-3
            if i >= 1:
                times.append(dt)
        dist.barrier()
        tr.close()
        out[str(n)] = nbytes * 8 / 1e9 / max(statistics.median(times), 1e-9)
    return out


PROBE_LATENCIES_MS = (2.0, 10.0, 20.0, 40.0)


def _wan_messages(rank: int, wan: dict, nbytes: int, repeats: int = 6, burst: int = 4) -> dict[str, Any]:
    """Per-message costs of the user-space WAN for one boundary tensor (ranks 0 -> 1, rank 1 blocked
    in `wait()` as a pipeline rank waiting for its input), on the spec's link rate:

    * "overhead_s": {latency_ms: median arrival - (send + size / rate + latency)} at each of
      PROBE_LATENCIES_MS -- the thread hand-offs of one message (caller -> dispatcher -> writer ->
      pacing -> reader -> delay timer -> waiting rank). It rises with the latency, i.e. with how long
      the delay-timer and reader threads sleep before they must run (see costs.message_overhead_s).
    * "gap_s": per message of a back-to-back burst, the arrival spacing beyond size / rate. The
      transport's dispatcher hands a destination's messages to the writers one at a time and waits
      until the last byte is written, and the pacer restarts from "now", so each message queued
      behind another pays one dispatcher + writer hand-off of link time again.

    Timestamps are CLOCK_MONOTONIC, the same clock in both processes; the send time travels on gloo."""
    import torch
    import torch.distributed as dist

    from geotrain.emulation.shaper import ShaperConfig
    from geotrain.runtime.wan import MIN_CHUNK_BYTES
    from geotrain.wan.striped import StripedTransport

    store = dist.distributed_c10d._get_default_store()
    rate = min(wan["per_connection_gbps"], wan["aggregate_gbps"]) * 1e9 / 8
    ser = nbytes / rate
    x = torch.ones(max(1, nbytes // 4))
    stamp = torch.zeros(burst, dtype=torch.float64)
    overhead: dict[str, float] = {}
    gaps: list[float] = []
    for lat in PROBE_LATENCIES_MS:
        cfg = ShaperConfig(per_connection_gbps=wan["per_connection_gbps"], aggregate_gbps=wan["aggregate_gbps"],
                           delay_ms=lat)
        tr = StripedTransport(rank, store, connections=1, shaper=cfg, prefix=f"profile/msg{lat:g}",
                              min_chunk_bytes=MIN_CHUNK_BYTES)
        xs = []
        for i in range(repeats + 1):
            dist.barrier()
            if rank == 0:
                time.sleep(0.005)       # the receiver is blocked in wait() before the send
                stamp[0] = time.monotonic()
                tr.send(x, 1, tag=i).wait()
                dist.send(stamp[:1], 1)
            elif rank == 1:
                tr.recv(x, 0, tag=i).wait()
                t1 = time.monotonic()
                dist.recv(stamp[:1], 0)
                if i >= 1:
                    xs.append(t1 - float(stamp[0]) - ser - lat * 1e-3)
        if lat == PROBE_LATENCIES_MS[1]:        # the burst: `burst` messages sent back to back
            for j in range(2):
                dist.barrier()
                if rank == 0:
                    works = [tr.send(x, 1, tag=1000 + burst * j + k) for k in range(burst)]
                    for w in works:
                        w.wait()
                elif rank == 1:
                    ends = []
                    for k in range(burst):
                        tr.recv(x, 0, tag=1000 + burst * j + k).wait()
                        ends.append(time.monotonic())
                    gaps.append((ends[-1] - ends[0]) / (burst - 1) - ser)
        dist.barrier()
        tr.close()
        if rank == 1:
            overhead[f"{lat:g}"] = max(0.0, statistics.median(xs))
    return {"bytes": nbytes, "overhead_s": overhead, "gap_s": max(0.0, min(gaps)) if gaps else 0.0}


def run_pool(world: int, task: dict, timeout_s: float = 180.0) -> tuple[list[dict], float]:
    """Run the multi-process measurements on `world` fresh processes (one CPU thread each); returns
    their results and the mean number of other threads ready to run meanwhile (cpuload.py)."""
    import tempfile

    from geotrain.calibrate.cpuload import CpuSampler
    from geotrain.runtime.launch import _kill_all, free_port

    with tempfile.TemporaryDirectory() as tmp:
        task_path = Path(tmp) / "task.json"
        task_path.write_text(json.dumps(task))
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, "-m", "geotrain.calibrate.profile", str(task_path), tmp],
                                  env={**env, "RANK": str(r)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  start_new_session=True) for r in range(world)]
        sampler = CpuSampler()
        try:
            deadline = time.time() + timeout_s
            while any(p.poll() is None for p in procs):
                sampler.sample([p.pid for p in procs])
                if time.time() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    bad = next((p for p in procs if p.poll() not in (None, 0)), None)
                    why = bad.stderr.read().decode(errors="replace").strip().splitlines()[-1:] if bad else ["timeout"]
                    raise RuntimeError(f"a profiling process failed: {why[0] if why else '?'}")
                time.sleep(0.05)
            return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)], \
                sampler.background_runnable()
        finally:
            _kill_all(procs)
            for p in procs:
                p.stderr.close()


def _calibration_run(spec, profile: dict, steps: int = 8, warmup: int = 2,
                     mode: str | None = None) -> tuple[dict[str, float], float, dict]:
    """Run a 2-stage pipeline of the spec's model for real (over the spec's WAN, through the runtime's
    launcher in WAN `mode`, as validation runs and `geotrain train` do) and compare each compute kind's
    mean duration with the calibrated simulation's: the ratio is what the runtime adds to the isolated
    unit times when ranks run side by side (the other rank's transfers and threads, the allocator, the
    recorder), beyond the CPU sharing costs.py models. From the same trace: the per-message WAN
    transport overhead and the global all-reduce (messages.py)."""
    import dataclasses
    import tempfile

    from geotrain.calibrate.compare import drop_warmup
    from geotrain.calibrate.costs import predict
    from geotrain.calibrate.wanrun import DEFAULT_MODE, run_plan
    from geotrain.plan.manual import plan_from_job, split_even
    from geotrain.plan.plan import StagePlan
    from geotrain.trace.schema import Trace

    base = plan_from_job(spec)
    dcs = [st.dc for st in base.stages]
    dcs = (dcs[0], dcs[-1])
    stages = tuple(StagePlan(dc=d, chunks=(r,)) for d, r in zip(dcs, split_even(spec.model.num_units, 2)))
    # The job's DP degree and sharding stay: with dp > 1 the ranks outnumber the cores here and the DP
    # collectives (FSDP all-gathers in every forward/backward under zero3) wait for partners that
    # are not running; the compute factors then carry that for the layout the job trains.
    plan = base.with_(stages=stages, schedule="1f1b", checkpointing="none",
                      num_microbatches=max(2, min(base.num_microbatches, 4)), extra_warmup=(), pipeline_offsets=(),
                      links=tuple(dataclasses.replace(lp, order=()) for lp in base.links),
                      name="profile-calibration")
    with tempfile.TemporaryDirectory() as tmp:
        path, cond = run_plan(spec, plan, Path(tmp) / "run", steps=steps, mode=mode or DEFAULT_MODE, warmup=warmup)
        measured = drop_warmup(Trace.read_jsonl(path), warmup)
    background, mode, slow = cond["background_runnable"], cond["mode"], cond["rank_slowdown"]
    # The factors are measured against the CPU share the ranks really got (run-queue wait), so they
    # hold what the runtime adds beyond CPU sharing, whatever else the machine ran meanwhile.
    sim, det = predict(spec, plan, profile, iterations=steps - warmup, background=background, mode=mode,
                       rank_slowdown=slow)
    pred_events = sim.trace.events

    def mean(events, kind):
        d = [e.duration for e in events if e.kind == kind]
        return sum(d) / len(d) if d else 0.0

    factors = {}
    for kind in ("forward", "backward", "optimizer"):
        p, m = mean(pred_events, kind), mean(measured.events, kind)
        if kind == "optimizer":       # the simulated step carries the global all-reduce; the trace records it apart
            p -= det["global_sync_s"]
        factors[kind] = m / p if p > 0 and m > 0 else 1.0
    info = {"plan": f"pp=2 x dp={plan.dp} 1f1b {plan.sharding}", "num_microbatches": plan.num_microbatches,
            "background_runnable": background, "steps": steps, "warmup": warmup, "wan_mode": mode,
            "rank_slowdown": slow}
    # What a WAN message and the global loss/overflow all-reduce cost, read off the trace
    # (messages.py says why not a fit on the iteration time).
    from geotrain.calibrate.messages import global_sync, waiting_overhead
    from geotrain.trace.metrics import compute_metrics

    measured_it = compute_metrics(measured, 1).iteration_time
    overhead = 0.0
    a, b = plan.stages[0].dc, plan.stages[-1].dc
    link = spec.cluster.link(a, b) if a != b else None
    if link is not None:
        lp = plan.link_between(a, b)
        conns = max(1, lp.connections) if lp is not None else 1
        rate_Bps = min(conns * link.per_connection_gbps, link.capacity_gbps) * 1e9 / 8
        overhead = waiting_overhead(measured, plan, link.latency_ms * 1e-3, 1 / rate_Bps, 0) or 0.0
    info["global_sync_s"] = global_sync(measured, 0) or 0.0
    info["latency_ms"] = link.latency_ms if link is not None else 0.0
    info["ranks"] = plan.num_ranks
    info["measured_iteration_s"] = measured_it
    # The background that makes the processor-sharing model (k ranks computing beside b others on C
    # cores: (k + b) / C) give the slow-down the ranks really had: the default for predictions of runs
    # nobody measured (`geotrain train --profile`).
    if slow:
        cores = int(profile[RUNTIME_KEY].get("cores", 1))
        k = sum(det["compute_concurrency"]) / len(det["compute_concurrency"])
        info["background_effective"] = max(0.0, cores * sum(slow.values()) / len(slow) - k)
    return factors, overhead, info


# -- the whole profile ---------------------------------------------------------------------------

def measure_profile(spec, *, quick: bool = False, micro_batches: list[int] | None = None,
                    precision: str | None = None, progress=None, mode: str | None = None) -> dict[str, Any]:
    """Measure a profile for `spec` (a loaded Spec) on this machine. quick: fewer repeats, dp=2 only.
    mode: the runtime WAN mode of the calibration run (default wanrun.DEFAULT_MODE); calibrate with the
    mode the predicted runs will use."""
    import torch

    from geotrain.cost import CostModel
    from geotrain.cost.memory import optimizer_step_bytes_per_param
    from geotrain.plan.manual import plan_from_job

    say = progress or (lambda msg: None)
    torch.set_num_threads(1)
    m, job = spec.model, spec.job
    plan = plan_from_job(spec)
    precision = precision or plan.precision
    mbs = sorted(set(micro_batches or [plan.micro_batch]))
    reps = 20 if quick else 40
    prof: dict[str, Any] = {"embedding": {}, "block": {}, "head": {}}
    say("units")
    for mb in mbs:
        for kind, index in (("embedding", 0), ("block", 1), ("head", m.layers + 1)):
            prof[kind][str(mb)] = list(time_unit(m, index, mb, precision, repeats=reps))

    split = time_split_backward(m, mbs[0], precision, repeats=10 if quick else 20)
    say("optimizer")
    sizes = [range(1, 2), range(1, min(m.layers, 3) + 1), range(0, m.num_units)]
    opt = [time_optimizer(m, u, job) for u in sizes]
    fixed, per_param = fit_line([p for p, _ in opt], [t for _, t in opt])
    step_bytes = optimizer_step_bytes_per_param(precision, job.optimizer)
    prof["memory_bytes_per_s"] = step_bytes / per_param if per_param > 0 else 1e12

    say("interpreter")
    spec_path = str(spec.path)
    interp = _interpreter(spec_path, mbs[0], max(2, plan.num_microbatches))
    units_fwd = prof["embedding"][str(mbs[0])][0] + m.layers * prof["block"][str(mbs[0])][0] + \
        prof["head"][str(mbs[0])][0]
    units_bwd = prof["embedding"][str(mbs[0])][1] + m.layers * prof["block"][str(mbs[0])][1] + \
        prof["head"][str(mbs[0])][1]

    cost = CostModel(m, precision=precision, checkpointing="none", optimizer=job.optimizer)
    stage_grad = cost.grad_bytes(plan.stages[0].units)
    grad_fp32 = stage_grad * 4 // cost.dtype_bytes            # the runtime reduces fp32 gradients
    boundary = cost.boundary_bytes(mbs[0])                    # boundary tensors travel in the training dtype
    link = next(iter(spec.cluster.wan_links), None)
    world = 4 if not quick else 2
    task = {"model": m.model_dump(), "micro_batch": mbs[0], "precision": precision,
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
        _calibration_run(spec, {**prof, RUNTIME_KEY: runtime}, mode=mode)
    say("process start-up")
    runtime["startup_s"] = measure_startup(1)
    prof[RUNTIME_KEY] = runtime
    return prof


if __name__ == "__main__":
    from geotrain.process import exit_skipping_teardown

    exit_skipping_teardown(pool_worker_main(sys.argv[1:]))   # output written; gloo threads may abort a normal exit
