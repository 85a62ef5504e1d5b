"""What a plan costs: GPU-hours at each DC's price_per_gpu_hour.

Per hour, per iteration and per million tokens; None where a DC the plan uses has no price.
WAN egress is not priced (the cluster spec has no egress price yet).
"""

from __future__ import annotations

from geotrain.config.cluster import Cluster
from geotrain.plan.plan import Plan

OBJECTIVES = ("throughput", "cost", "cost-per-token")


def cost_per_hour(cluster: Cluster, plan: Plan) -> float | None:
    total = 0.0
    for dc, n in plan.gpus_per_dc().items():
        p = cluster.dc(dc).price_per_gpu_hour
        if p is None:
            return None
        total += n * p
    return total


def cost_per_iteration(cluster: Cluster, plan: Plan, iteration_s: float) -> float | None:
    h = cost_per_hour(cluster, plan)
    return None if h is None else h * iteration_s / 3600


def cost_per_mtoken(cluster: Cluster, plan: Plan, iteration_s: float, seq_len: int) -> float | None:
    it = cost_per_iteration(cluster, plan, iteration_s)
    return None if it is None else it / (plan.global_batch * seq_len) * 1e6
