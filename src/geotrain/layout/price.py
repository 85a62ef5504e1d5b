"""What a plan costs: GPU-hours at each DC's price_per_gpu_hour, plus WAN egress at each link's
egress_usd_per_gb.

Per hour, per iteration and per million tokens; None where a DC the plan uses has no GPU price
(a link without an egress price costs nothing to cross). Egress is per byte sent over a link,
either way, counted by layout.wan_bytes (the one definition: pipeline activations and gradients,
a region plan's DP sync with every reduce-scatter and all-gather its sharding runs, the tied
embedding's gradient sum) -- the same bytes `plan`/`simulate` print.
"""

from __future__ import annotations

from geotrain.layout.plan import Plan
from geotrain.layout.wan_bytes import wan_bytes_per_direction
from geotrain.spec.cluster import Cluster
from geotrain.spec.load import Spec

OBJECTIVES = ("throughput", "cost", "cost-per-token")


def wan_bytes_per_link(spec: Spec, plan: Plan) -> dict[tuple[str, str], float]:
    """Bytes per iteration over each WAN link the plan uses, both directions (key: the two DCs,
    sorted), from the one definition (layout.wan_bytes: pipeline, DP sync, tied embedding sum)."""
    out: dict[tuple[str, str], float] = {}
    for (a, b), nbytes in wan_bytes_per_direction(spec, plan).items():
        key = (min(a, b), max(a, b))
        out[key] = out.get(key, 0.0) + nbytes
    return out


def egress_per_iteration(spec: Spec, plan: Plan) -> float:
    """$ of WAN egress per iteration (links without egress_usd_per_gb are free: with none priced,
    the bytes are not counted)."""
    if not any(link.egress_usd_per_gb for link in spec.cluster.wan_links):
        return 0.0
    total = 0.0
    for (a, b), nbytes in wan_bytes_per_link(spec, plan).items():
        link = spec.cluster.link(a, b)
        if link is not None and link.egress_usd_per_gb:
            total += nbytes / 1e9 * link.egress_usd_per_gb
    return total


def cost_per_hour(cluster: Cluster, plan: Plan, iteration_s: float | None = None,
                  egress_usd: float = 0.0) -> float | None:
    """GPU-hours' price, plus the egress of the iterations an hour runs when `iteration_s` is given."""
    total = gpu_cost_per_hour(cluster, plan.gpus_per_dc())
    if total is None:
        return None
    if egress_usd and iteration_s:
        total += egress_usd * 3600 / iteration_s
    return total


def gpu_cost_per_hour(cluster: Cluster, gpus_per_dc: dict[str, int]) -> float | None:
    """$/hour of these GPUs ({DC: count}); None when one of the DCs has no price_per_gpu_hour."""
    total = 0.0
    for dc, n in gpus_per_dc.items():
        p = cluster.dc(dc).price_per_gpu_hour
        if p is None:
            return None
        total += n * p
    return total


def cost_per_iteration(cluster: Cluster, plan: Plan, iteration_s: float, egress_usd: float = 0.0) -> float | None:
    h = cost_per_hour(cluster, plan)
    return None if h is None else h * iteration_s / 3600 + egress_usd


def cost_per_mtoken(cluster: Cluster, plan: Plan, iteration_s: float, seq_len: int,
                    egress_usd: float = 0.0) -> float | None:
    it = cost_per_iteration(cluster, plan, iteration_s, egress_usd)
    return None if it is None else it / (plan.global_batch * seq_len) * 1e6
