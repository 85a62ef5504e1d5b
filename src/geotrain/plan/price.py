"""What a plan costs: GPU-hours at each DC's price_per_gpu_hour, plus WAN egress at each link's
egress_usd_per_gb.

Per hour, per iteration and per million tokens; None where a DC the plan uses has no GPU price
(a link without an egress price costs nothing to cross). Egress is per byte sent over a link,
either way, counted from the plan: a pipeline boundary between DCs carries each micro-batch's
activation forward and its gradient back, for every DP pipeline; a region plan's gradient
sync sends, per reduce-scatter/all-gather half, (k-1)/k of each stage's gradient over each hop
of the ring through its k DCs (the volume cost.comm.cross_dc_sync_time prices in time).
"""

from __future__ import annotations

from geotrain.config.cluster import Cluster
from geotrain.config.load import Spec
from geotrain.cost import CostModel
from geotrain.cost.comm import HALVES_PER_ITERATION
from geotrain.plan.plan import Plan

OBJECTIVES = ("throughput", "cost", "cost-per-token")


def wan_bytes_per_link(spec: Spec, plan: Plan) -> dict[tuple[str, str], float]:
    """Bytes per iteration over each WAN link the plan uses (key: the two DCs, sorted)."""
    cost = CostModel(spec.model, precision=plan.precision, checkpointing="none", optimizer=spec.job.optimizer)
    out: dict[tuple[str, str], float] = {}

    def add(a: str, b: str, nbytes: float) -> None:
        if a != b:
            key = (min(a, b), max(a, b))
            out[key] = out.get(key, 0.0) + nbytes

    pp, nv = plan.pp, plan.pp * plan.virtual_per_stage
    per_copy = plan.dp * plan.num_microbatches * cost.boundary_bytes(plan.micro_batch)
    for v in range(nv - 1):   # virtual stage v hands over to v + 1 (activation forward, gradient back),
        # one copy to each receiving TP rank (sim/program.py): tp of v + 1 forward, tp of v back
        a, b = v % pp, (v + 1) % pp
        add(plan.stages[a].dc, plan.stages[b].dc, per_copy * (plan.stage_tp(a) + plan.stage_tp(b)))
    if plan.replica_dcs:
        ring = [d for d, _ in plan.replicas_per_dc()]
        k = len(ring)
        halves = HALVES_PER_ITERATION["zero3" if plan.sharding == "fsdp" else plan.sharding]
        grads = sum(cost.grad_bytes(st.units) for st in plan.stages)   # every tp slice
        for i in range(k):
            add(ring[i], ring[(i + 1) % k], halves * (k - 1) / k * grads)
    return out


def egress_per_iteration(spec: Spec, plan: Plan) -> float:
    """$ of WAN egress per iteration (links without egress_usd_per_gb are free)."""
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
