"""Synthetic clusters, plans and costs with round numbers, for tests, benchmarks and what-ifs.

A chain of DCs, each WAN link with the given latency and bandwidth; stages spread over the DCs
in contiguous blocks; uniform per-stage costs. Closed-form checks need such hand-sized inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from geotrain.config import Cluster
from geotrain.plan.plan import LinkPlan, Plan, StagePlan
from geotrain.sim.simulate import StageCost


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
