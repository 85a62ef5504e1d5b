"""Temporal bandwidth sharing of WAN links between the DP pipelines (Atlas).

With dp pipelines running in lockstep, every WAN boundary sees dp activation transfers start at
the same moment; under fair sharing each gets 1/dp of the link, so every one of them arrives
late. Temporal sharing lets them take turns instead, each transfer at the link's full rate (or,
when one transfer's connections cannot fill it, a few at once that do: `concurrent_turns`).
The turns are work-conserving (a ready transfer never waits while the link has room), so the
link itself staggers the pipelines: after the first micro-batch they are one turn apart. That is
why the plan starts them in lockstep by default -- start offsets of (d // slots) x stagger
(wrapped into one steady-state period) only delay the pipelines' compute, since sends do not
block: in the simulator they are never faster than lockstep (toy pipelines d = 2, 4, 8, 1-8
micro-batches: equal, or up to 1% slower with several micro-batches; tiny_2dc-like plans at
dp = 2, 4, 8: equal). `apply_temporal(offsets=True)` still writes them, for the planner to offer
as a variant; it keeps one only where the simulator does not find it slower (a tie goes to
lockstep, listed first).
"""

from __future__ import annotations

from collections.abc import Sequence

from geotrain.layout.plan import LinkPlan, Plan
from geotrain.planner.context import GBIT
from geotrain.spec.cluster import Cluster, WanLink
from geotrain.transport.turns import concurrent_turns


def turn_rate_gbps(link: WanLink, connections: int, dp: int | None = None) -> float:
    """The rate one transfer gets under work-conserving turns: its connections' rate, or its share
    when several transfers hold the link at once to fill it (`concurrent_turns`)."""
    flow = link.rate_gbps(connections)
    slots = concurrent_turns(link.capacity_gbps, flow)
    if dp is not None:
        slots = min(slots, dp)
    return min(flow, link.capacity_gbps / slots)


def transfer_time(cluster: Cluster, lp: LinkPlan, nbytes: int) -> float:
    """Seconds to move `nbytes` over the link in one turn (no latency)."""
    link = cluster.link(lp.src_dc, lp.dst_dc)
    if link is None:
        raise ValueError(f"no WAN link between {lp.src_dc} and {lp.dst_dc}")
    return nbytes / (turn_rate_gbps(link, lp.connections) * GBIT)


def pipeline_offsets(dp: int, stagger: float, period: float, slots: int = 1) -> tuple[float, ...]:
    """Start offset of each DP pipeline: (d // slots) * stagger, wrapped into one steady-state
    period -- `slots` pipelines hold the link at once (`concurrent_turns`), so they start together
    (d * stagger with 4 slots delayed pipelines that had a slot free: up to 3% slower than lockstep)."""
    slots = max(1, int(slots))
    if dp <= slots or stagger <= 0:
        return (0.0,) * dp
    wrap = max(period, stagger * 1.000001)
    return tuple(round(((d // slots) * stagger) % wrap, 9) for d in range(dp))


def offsets_span(dp: int, stagger: float, period: float) -> float:
    """The largest offset (without building the list): (dp - 1) stagger, at most one period."""
    if dp <= 1 or stagger <= 0:
        return 0.0
    return min((dp - 1) * stagger, max(period, stagger))


def flow_share(plan: Plan, lp: LinkPlan) -> float:
    """The part of a boundary tensor one flow (one TP index's turn) carries over the link: 1/tp
    between stages of equal tp (scattered, Plan.boundary_scattered), else a whole copy."""
    share = 0.0
    for s in range(plan.pp):
        r = (s + 1) % plan.pp
        if r != s and {plan.stages[s].dc, plan.stages[r].dc} == {lp.src_dc, lp.dst_dc}:
            share = max(share, plan.boundary_copies(s, r) / plan.stage_tp(r),
                        plan.boundary_copies(r, s) / plan.stage_tp(s))
    return share or 1.0


def apply_temporal(plan: Plan, cluster: Cluster, boundary_bytes: int, period: float, offsets: bool = False) -> Plan:
    """The plan with every WAN link shared temporally: order = the DP pipelines' order, stagger =
    the slowest WAN link's one-micro-batch turn (one stagger for all links, so a pipeline keeps
    its slot at every boundary); pipeline start offsets from it only with `offsets`."""
    if not plan.links or plan.dp <= 1:
        return apply_fair(plan)
    stagger, slowest = max(((transfer_time(cluster, lp, int(boundary_bytes * flow_share(plan, lp))), lp)
                            for lp in plan.links), key=lambda x: x[0])
    link = cluster.link(slowest.src_dc, slowest.dst_dc)
    slots = concurrent_turns(link.capacity_gbps, link.rate_gbps(slowest.connections))
    order = tuple(range(plan.dp))
    links = tuple(LinkPlan(src_dc=lp.src_dc, dst_dc=lp.dst_dc, connections=lp.connections, sharing="temporal",
                           order=order, stagger_s=stagger) for lp in plan.links)
    starts = pipeline_offsets(plan.dp, stagger, period, slots) if offsets else ()
    return plan.with_(links=links, pipeline_offsets=starts)


def apply_fair(plan: Plan) -> Plan:
    links = tuple(LinkPlan(src_dc=lp.src_dc, dst_dc=lp.dst_dc, connections=lp.connections, sharing="fair")
                  for lp in plan.links)
    return plan.with_(links=links, pipeline_offsets=())


def with_connections(plan: Plan, connections: Sequence[int]) -> Plan:
    links = tuple(LinkPlan(src_dc=lp.src_dc, dst_dc=lp.dst_dc, connections=int(n), sharing=lp.sharing,
                           order=lp.order, stagger_s=lp.stagger_s)
                  for lp, n in zip(plan.links, connections, strict=True))
    return plan.with_(links=links)
