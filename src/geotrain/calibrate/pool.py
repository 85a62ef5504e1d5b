"""The profile's multi-process measurements: CPU contention, gloo collectives, p2p, the WAN.

`run_pool` starts `world` processes of `python -m geotrain.calibrate.pool` on the runtime's own
launcher (`runtime.launch.launch_ranks`: the torchrun environment, clean-up on any failure, the
first failure named) and samples the machine's other load meanwhile (cpuload.py). Every rank runs
every probe; the WAN probes go through the runtime's `StripedTransport` with the user-space shaper
(the same configuration as `runtime.rank_run.build_transport` in shaper mode).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geotrain.calibrate.cpuload import CpuSampler
from geotrain.calibrate.timers import low_percentile, unit_runner
from geotrain.emulation.user_shaper import ShaperConfig
from geotrain.errors import GeotrainError
from geotrain.models.shape import ModelShape
from geotrain.process import exit_skipping_teardown
from geotrain.runtime.cross_dc import MIN_CHUNK_BYTES
from geotrain.runtime.launch import launch_ranks
from geotrain.runtime.worker import write_error
from geotrain.torch_compat import default_store
from geotrain.transport.striped import StripedTransport


def pool_worker_main(argv: list[str]) -> int:
    """Entry of one pool process: `python -m geotrain.calibrate.pool TASK.json OUT_DIR` with RANK,
    WORLD_SIZE, MASTER_ADDR/PORT set (runtime.launch); writes OUT_DIR/rank<R>.json, or on failure
    the launcher's error file."""
    task = json.loads(Path(argv[0]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    except BaseException as e:  # noqa: BLE001 -- reported to the launcher, as a training rank's would be
        write_error(e)
        return 1
    try:
        out: dict[str, Any] = {}
        out["contention"] = _contention(rank, world, task)
        out["allreduce"] = _allreduce(rank, world, task)
        out["p2p"] = _p2p(rank, task)
        if task.get("wan"):
            out["wan"] = _wan_rates(rank, task["wan"])
            out["wan_messages"] = _wan_messages(rank, task["wan"], task["boundary_bytes"])
        (Path(argv[1]) / f"rank{rank}.json").write_text(json.dumps(out))
    except BaseException as e:  # noqa: BLE001 -- reported to the launcher, as a training rank's would be
        write_error(e)
        return 1
    finally:
        dist.destroy_process_group()
    return 0


def _contention(rank: int, world: int, task: dict) -> dict[str, float]:
    """Per k = 1..world: median seconds of one block forward+backward while k ranks compute at once."""
    once = unit_runner(ModelShape(**task["model"]), 1, task["micro_batch"], task["precision"])
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
            rows.append((nbytes, low_percentile(times)))
        out[str(n)] = rows
    return out


def _p2p(rank: int, task: dict) -> list[tuple[int, float]]:
    """One-way isend/irecv time between ranks 0 and 1 (half a ping-pong)."""
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
        rows.append((nbytes, low_percentile(times)))
    return rows


def _wan_rates(rank: int, wan: dict) -> dict[str, float]:
    """Achieved Gbit/s of one transfer over the user-space WAN with n connections (ranks 0 -> 1)."""
    store = default_store()
    out = {}
    for n in wan["connections"]:
        # The runtime's shaper mode: both caps, exact pacing, 4 KB stripes (runtime.rank_run.build_transport).
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
      the delay-timer and reader threads sleep before they must run (see calibrated_links.message_overhead_s).
    * "gap_s": per message of a back-to-back burst, the arrival spacing beyond size / rate. The
      transport's dispatcher hands a destination's messages to the writers one at a time and waits
      until the last byte is written, and the pacer restarts from "now", so each message queued
      behind another pays one dispatcher + writer hand-off of link time again.

    Timestamps are CLOCK_MONOTONIC, the same clock in both processes; the send time travels on gloo."""
    store = default_store()
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
    """Run the multi-process measurements on `world` fresh processes (one CPU thread each), started
    by the runtime's launcher; returns their results and the mean number of other threads ready to
    run meanwhile (cpuload.py)."""
    sampler = CpuSampler()
    with tempfile.TemporaryDirectory() as tmp:
        task_path = Path(tmp) / "task.json"
        task_path.write_text(json.dumps(task))
        try:
            launch_ranks([sys.executable, "-m", "geotrain.calibrate.pool", str(task_path), tmp], world,
                         Path(tmp) / "logs", threads=1, timeout_s=timeout_s, rank0_stdout=False,
                         describe=lambda r: "profiling process",
                         watch=lambda procs: sampler.sample([p.pid for p in procs]))
        except GeotrainError as e:
            raise GeotrainError(f"profiling: {str(e).split(' (logs: ')[0]}") from None
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)], \
            sampler.background_runnable()


if __name__ == "__main__":
    exit_skipping_teardown(pool_worker_main(sys.argv[1:]))   # output written; gloo threads may abort a normal exit
