"""Simulator speed: one iteration of pp=16 x dp=64 (1,024 GPUs) and pp=16 x dp=256 (4,096 GPUs),
64 micro-batches, stages spread over 4 DCs joined by WAN links (both sharing policies).

Prints, per case: actions simulated, trace events, engine time, wall and CPU time of the whole
simulate_costs call (engine + trace columns + metrics), events per second, and the ratio against
the 2 s target. CPU time is printed too because the machine is often shared: wall time then
includes waiting for a core.

    .venv/bin/python bench/bench_sim.py [--quick]
"""

from __future__ import annotations

import argparse
import time

from geotrain.layout.plan import LinkPlan, Plan, StagePlan
from geotrain.sim import StageCost, simulate_costs
from geotrain.spec import Cluster

TARGET_S = 2.0


def make_case(pp: int, dp: int, m: int, dcs: int, sharing: str) -> tuple[Plan, Cluster]:
    names = [f"dc{i}" for i in range(dcs)]
    cluster = Cluster.model_validate({
        "datacenters": [{"name": n, "gpu_type": "h100-80g", "gpus": dp * pp} for n in names],
        "wan_links": [{"between": [names[i], names[i + 1]], "latency_ms": 20, "capacity_gbps": 400,
                       "per_connection_gbps": 10, "max_connections": 64} for i in range(dcs - 1)],
    })
    per = pp // dcs
    stages = tuple(StagePlan(dc=names[min(s // per, dcs - 1)], chunks=((s, s + 1),)) for s in range(pp))
    links = tuple(LinkPlan(src_dc=names[i], dst_dc=names[i + 1], connections=40, sharing=sharing,
                           order=tuple(range(dp))) for i in range(dcs - 1))
    plan = Plan(stages=stages, dp=dp, micro_batch=1, num_microbatches=m, schedule="1f1b", links=links)
    return plan, cluster


def run_case(pp: int, dp: int, m: int, dcs: int, sharing: str) -> None:
    plan, cluster = make_case(pp, dp, m, dcs, sharing)
    costs = [StageCost(forward=0.010, backward=0.020, backward_input=0.012, backward_weight=0.008,
                       send_bytes=16 * 2**20 if s < pp - 1 else 0) for s in range(pp)]
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate_costs(plan, cluster, costs, [0.05] * pp, [0.01] * pp, tokens_per_iteration=dp * m * 4096)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    eng = res.trace.meta["engine"]
    n_events = len(res.trace.columns())
    t1 = time.perf_counter()
    ev = res.trace.events
    t_events = time.perf_counter() - t1
    gpus = pp * dp
    print(f"{gpus:5d} GPUs pp={pp} dp={dp} m={m} {sharing:8s}: {eng['actions']:,} actions, {n_events:,} events "
          f"({eng['wan_events']:,} through the heap)\n    engine {eng['wall_s']:.2f} s; simulate_costs total "
          f"{wall:.2f} s wall, {cpu:.2f} s CPU -> {eng['actions'] / eng['wall_s'] / 1e6:.2f} M actions/s, "
          f"{n_events / wall / 1e6:.2f} M events/s; wall {wall / TARGET_S:.2f}x / CPU {cpu / TARGET_S:.2f}x the "
          f"{TARGET_S:.0f} s target\n    predicted iteration {res.metrics.iteration_time:.3f} s; "
          f"Event objects on request: {t_events:.2f} s ({len(ev):,})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the 1,024-GPU cases")
    args = ap.parse_args()
    for sharing in ("fair", "temporal"):
        run_case(16, 64, 64, 4, sharing)
    if not args.quick:
        for sharing in ("fair", "temporal"):
            run_case(16, 256, 64, 4, sharing)


if __name__ == "__main__":
    main()
