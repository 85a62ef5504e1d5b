"""Test fixture: synthetic clusters, plans and costs with round numbers (moved out of the package).

A chain of DCs, each WAN link with the given latency and bandwidth; stages spread over the DCs
in contiguous blocks; uniform per-stage costs. Closed-form checks need such hand-sized inputs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from geotrain.layout.plan import LinkPlan, Plan, StagePlan
from geotrain.sim.simulate import StageCost
from geotrain.spec import Cluster


def toy_cluster(dcs: int = 2, *, gpus: int = 4096, latency_ms: float = 10.0, capacity_gbps: float = 100.0,
                per_connection_gbps: float = 10.0, max_connections: int = 64, intra_gbps: float = 200.0,
                intra_latency_us: float = 5.0) -> Cluster:
    names = [f"dc{i}" for i in range(dcs)]
    return Cluster.model_validate({
        "name": f"toy-{dcs}dc",
        "datacenters": [{"name": n, "gpu_type": "h100-80g", "gpus": gpus, "intra_dc_gbps": intra_gbps,
                         "intra_dc_latency_us": intra_latency_us} for n in names],
        "wan_links": [{"between": [names[i], names[i + 1]], "latency_ms": latency_ms, "capacity_gbps": capacity_gbps,
                       "per_connection_gbps": per_connection_gbps, "max_connections": max_connections}
                      for i in range(dcs - 1)],
    })


def toy_plan(pp: int, dp: int, m: int, *, dcs: int = 1, schedule: str = "1f1b", stage_dcs: Sequence[int] | None = None,
             connections: int = 1, sharing: str = "fair", order: Sequence[int] = (), virtual_per_stage: int = 1,
             pipeline_offsets: Sequence[float] = (), extra_warmup: Sequence[int] = ()) -> Plan:
    """pp stages over `dcs` DCs (contiguous blocks unless `stage_dcs` gives each stage's DC index);
    one unit per virtual stage."""
    if stage_dcs is None:
        stage_dcs = [min(s * dcs // pp, dcs - 1) for s in range(pp)]
    stages = tuple(StagePlan(dc=f"dc{stage_dcs[s]}", chunks=tuple((c * pp + s, c * pp + s + 1)
                                                                  for c in range(virtual_per_stage)))
                   for s in range(pp))
    pairs = sorted({tuple(sorted((stages[s].dc, stages[(s + 1) % pp].dc))) for s in range(pp)
                    if stages[s].dc != stages[(s + 1) % pp].dc})
    links = tuple(LinkPlan(src_dc=a, dst_dc=b, connections=connections, sharing=sharing, order=tuple(order))
                  for a, b in pairs)
    return Plan(stages=stages, dp=dp, micro_batch=1, num_microbatches=m, schedule=schedule, links=links,
                pipeline_offsets=tuple(pipeline_offsets), extra_warmup=tuple(extra_warmup), name="toy")


def uniform_costs(num_virtual: int, forward: float, backward: float, send_bytes: int = 0,
                  split: float = 0.5) -> list[StageCost]:
    """The same cost on every virtual stage; backward split `split` : 1 - split into input and weight
    gradients; the last stage sends nothing onward."""
    return [StageCost(forward=forward, backward=backward, backward_input=backward * split,
                      backward_weight=backward * (1 - split), send_bytes=send_bytes if v < num_virtual - 1 else 0)
            for v in range(num_virtual)]


def random_case(seed: int) -> tuple[Plan, Cluster, list[StageCost], list[float], list[float], int]:
    """A random small case for fuzzing: (plan, cluster, stage costs, allreduce times, optimizer
    times, iterations). All schedule kinds, mostly across 2-3 DCs, both sharing policies,
    uneven costs, pipeline offsets."""
    rng = random.Random(seed)
    kind = rng.choice(["gpipe", "1f1b", "zb-h1", "interleaved", "wan-1f1b"])
    pp = rng.randint(1 if kind != "interleaved" else 2, 5)
    dp = rng.randint(1, 3)
    m = rng.randint(1, 7)
    vps = 1
    extra: tuple[int, ...] = ()
    if kind == "interleaved":
        vps = 2
        m = pp * rng.randint(1, 2)
    if kind == "wan-1f1b":
        extra = tuple(sorted((rng.randint(0, 2) for _ in range(pp)), reverse=True))
    dcs = rng.randint(2, min(3, pp)) if pp >= 2 and rng.random() < 0.8 else 1   # mostly across a WAN
    if kind == "interleaved" and dcs == 3:
        dcs = 2          # the last stage sends back to the first: needs a direct link
    stage_dcs = sorted(rng.sample(range(pp), dcs - 1)) if dcs > 1 else []
    stage_dc = [sum(s > c for c in stage_dcs) for s in range(pp)]  # contiguous blocks
    sharing = rng.choice(["fair", "temporal"])
    order = tuple(rng.sample(range(dp), dp))
    offsets = tuple(rng.choice([0.0, rng.uniform(0, 0.05)]) for _ in range(dp))
    plan = toy_plan(pp, dp, m, dcs=dcs, stage_dcs=stage_dc, schedule=kind, connections=rng.randint(1, 4),
                    sharing=sharing, order=order, virtual_per_stage=vps, pipeline_offsets=offsets,
                    extra_warmup=extra)
    cluster = toy_cluster(max(dcs, 1), latency_ms=rng.uniform(0, 30), capacity_gbps=rng.uniform(1, 20),
                          per_connection_gbps=rng.uniform(0.5, 10), intra_latency_us=rng.uniform(0, 50))
    nv = pp * vps
    costs = []
    for v in range(nv):
        f = rng.uniform(0.001, 0.02)
        bi, bw = rng.uniform(0.001, 0.02), rng.uniform(0.0, 0.02)
        costs.append(StageCost(forward=f, backward=bi + bw, backward_input=bi, backward_weight=bw,
                               send_bytes=rng.randint(0, 2 * 10**7) if v < nv - 1 else 0))
    allreduce = [rng.uniform(0, 0.01) for _ in range(pp)]
    optimizer = [rng.uniform(0, 0.01) for _ in range(pp)]
    iterations = rng.randint(1, 2)
    return plan, cluster, costs, allreduce, optimizer, iterations
