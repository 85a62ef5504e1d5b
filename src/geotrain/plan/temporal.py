"""Temporal bandwidth sharing of WAN links between the DP pipelines (Atlas).

With dp pipelines running in lockstep, every WAN boundary sees dp activation transfers start at
the same moment; under fair sharing each gets 1/dp of the link, so every one of them arrives
late. Temporal sharing lets them take turns instead: pipeline d starts `d * stagger` later, where
`stagger` is one micro-batch's transfer time at the link's full rate, so each transfer finds the
link free and runs at full speed. The offsets wrap around the steady-state period (a pipeline
shifted by a whole period is back in the same slot), so the cost is at most one period of start
delay, while every transfer's delay shrinks by a factor of about dp.
"""

from __future__ import annotations

from collections.abc import Sequence

from geotrain.config.cluster import Cluster
from geotrain.plan.context import GBIT
from geotrain.plan.plan import LinkPlan, Plan


def transfer_time(cluster: Cluster, lp: LinkPlan, nbytes: int) -> float:
    """Seconds to move `nbytes` over the link at its full rate with lp.connections (no latency)."""
    link = cluster.link(lp.src_dc, lp.dst_dc)
    if link is None:
        raise ValueError(f"no WAN link between {lp.src_dc} and {lp.dst_dc}")
    return nbytes / (link.rate_gbps(lp.connections) * GBIT)


def pipeline_offsets(dp: int, stagger: float, period: float) -> tuple[float, ...]:
    """Start offset of each DP pipeline: d * stagger, wrapped into one steady-state period."""
    if dp <= 1 or stagger <= 0:
        return (0.0,) * dp
    wrap = max(period, stagger * 1.000001)
    return tuple(round((d * stagger) % wrap, 9) for d in range(dp))


def offsets_span(dp: int, stagger: float, period: float) -> float:
    """The largest offset (without building the list): (dp - 1) stagger, at most one period."""
    if dp <= 1 or stagger <= 0:
        return 0.0
    return min((dp - 1) * stagger, max(period, stagger))


def apply_temporal(plan: Plan, cluster: Cluster, boundary_bytes: int, period: float) -> Plan:
    """The plan with every WAN link shared temporally: order = the DP pipelines' order, stagger =
    the slowest WAN link's one-micro-batch transfer time at full rate (one stagger for all links,
    so a pipeline keeps its slot at every boundary), pipeline offsets set accordingly."""
    if not plan.links or plan.dp <= 1:
        return apply_fair(plan)
    stagger = max(transfer_time(cluster, lp, boundary_bytes) for lp in plan.links)
    order = tuple(range(plan.dp))
    links = tuple(LinkPlan(src_dc=lp.src_dc, dst_dc=lp.dst_dc, connections=lp.connections, sharing="temporal",
                           order=order, stagger_s=stagger) for lp in plan.links)
    return plan.with_(links=links, pipeline_offsets=pipeline_offsets(plan.dp, stagger, period))


def apply_fair(plan: Plan) -> Plan:
    links = tuple(LinkPlan(src_dc=lp.src_dc, dst_dc=lp.dst_dc, connections=lp.connections, sharing="fair")
                  for lp in plan.links)
    return plan.with_(links=links, pipeline_offsets=())


def with_connections(plan: Plan, connections: Sequence[int]) -> Plan:
    links = tuple(LinkPlan(src_dc=lp.src_dc, dst_dc=lp.dst_dc, connections=int(n), sharing=lp.sharing,
                           order=lp.order, stagger_s=lp.stagger_s)
                  for lp, n in zip(plan.links, connections, strict=True))
    return plan.with_(links=links)
