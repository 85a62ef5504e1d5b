"""Benchmark: the all-reduce model the simulator prices DP with, beside gloo measured here.

The cost model (geotrain.costs.comm) times a ring all-reduce of B bytes over n ranks as
2 (n-1)/n x B / bandwidth + 2 (n-1) x latency, hierarchical across nodes. This measures
`torch.distributed.all_reduce` with gloo on 127.0.0.1 at 2, 4 and 8 ranks (one process each,
one launch per rank count, median of `--reps` after a warm-up) for a few sizes, and prints it
beside the model with the spec's DC numbers (default: examples/clusters/tiny_2dc.toml's "east",
the DC the emulated runs use) and beside a model fitted to the measurement (least squares of
time against 2 (n-1)/n x B and 2 (n-1): the bandwidth and per-step latency this machine gives),
so the DP cost that decides between plans is checked against a measurement, not assumed.
On a shared 2-core machine 8 ranks oversubscribe the cores: the numbers carry that (say so).

Run: .venv/bin/python bench/bench_allreduce.py [--sizes-mb 1,8,32] [--ranks 2,4,8] [--reps 10]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, sizes: list[int], reps: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x)                       # warm-up: connections, buffers
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        res[nbytes] = statistics.median(times)
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def measure(world: int, sizes: list[int], reps: int) -> dict[int, float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, sizes, reps, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return res


def main() -> int:
    sys.path.insert(0, str(ROOT / "src"))
    from geotrain.costs.comm import allreduce_time
    from geotrain.spec.load import load_cluster

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="1,8,32")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cluster", default=str(ROOT / "examples" / "clusters" / "tiny_2dc.toml"))
    ap.add_argument("--dc", default="east")
    args = ap.parse_args()
    sizes = [int(float(s) * 2**20) for s in args.sizes_mb.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    dc = load_cluster(args.cluster).dc(args.dc)
    print(f"gloo all-reduce on 127.0.0.1 (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores); "
          f"model: {args.dc} of {Path(args.cluster).name} (one node of {dc.gpus_per_node} ranks, "
          f"{dc.intra_node_gbps:g} Gbit/s, {dc.intra_dc_latency_us:g} us)")
    rows = []
    for n in ranks:
        got = measure(n, sizes, args.reps)
        for b in sizes:
            rows.append((n, b, got[b]))
    # Fit t = a * 2(n-1)/n * B + c * 2(n-1) (bandwidth 1/a, per-step latency c), least squares.
    xs = [(2 * (n - 1) / n * b, 2 * (n - 1)) for n, b, _ in rows]
    ys = [t for _, _, t in rows]
    s11 = sum(x[0] * x[0] for x in xs)
    s12 = sum(x[0] * x[1] for x in xs)
    s22 = sum(x[1] * x[1] for x in xs)
    t1 = sum(x[0] * y for x, y in zip(xs, ys))
    t2 = sum(x[1] * y for x, y in zip(xs, ys))
    det = s11 * s22 - s12 * s12
    a, c = (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det
    if c < 0:                     # a latency below zero fits noise, not the machine: bandwidth only
        a, c = t1 / s11, 0.0
    print(f"fitted: {8 / a / 1e9:.2f} Gbit/s per rank, {c * 1e6:.0f} us per ring step\n")
    print(f"{'ranks':>5} {'MiB':>6} {'measured ms':>12} {'model ms':>9} {'model/meas':>10} {'fitted ms':>10}")
    for (n, b, t), (x1, x2) in zip(rows, xs):
        model = allreduce_time(b, n, max(dc.gpus_per_node, n), dc)
        fit = a * x1 + c * x2
        print(f"{n:>5} {b / 2**20:>6.0f} {t * 1e3:>12.2f} {model * 1e3:>9.2f} {model / t:>10.2f} {fit * 1e3:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
