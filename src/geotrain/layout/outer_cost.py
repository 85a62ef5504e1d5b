"""What DiLoCo's outer exchange costs: bytes per WAN link direction and seconds, per exchange and
per inner step -- the one count the simulator's timeline (sim.outer), the planner's modes
(planner.modes) and the WAN byte totals (layout.wan_bytes) read.

As runtime.outer_group runs it: rank i of every worker exchanges its part of a fragment (its
local parameters -- a TP/FSDP shard, or 1/dp of them where DP replicas hold the same ones -- cut
into F fragments) with rank i of every other worker, directly: to each of the k - 1 others the
part that one owns (reduce-scatter), then its own averaged part to each (all-gather), both
encoded by the outer codec (costs.compression.outer_wire_bytes). So per exchange a link
direction between two workers' DCs carries 2 / k of each rank's fragment per rank pair that
crosses it. Time: two phases, each one-way latency plus the direction's bytes at min(capacity,
flows x connections x per-connection rate; with temporal sharing the ranks of a worker take turns,
transport.turns.turn_slots of them at once, each turn's grant on top), the last send acknowledged
(one round trip), and the commit in the workers' store (about two round trips to it, in the first
worker's DC).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from geotrain.costs.compression import outer_wire_bytes
from geotrain.transport.turns import TURN_OVERHEAD_S, turn_slots

GBIT = 1e9 / 8
STORE_ROUND_TRIPS = 2


@dataclass
class OuterCost:
    exchange_s: float                                   # one fragment's exchange (the slowest direction)
    exchange_bytes: dict[tuple[str, str], float] = field(default_factory=dict)   # per direction, one exchange
    optimizer_s: float = 0.0                            # the outer step of one fragment on a rank
    exposed_s: float = 0.0                              # per exchange, what the overlap does not hide
    per_step_s: float = 0.0                             # amortized over the inner steps
    per_step_bytes: dict[tuple[str, str], float] = field(default_factory=dict)

    @property
    def wan_bytes_per_step(self) -> float:
        return sum(self.per_step_bytes.values())


def rank_numel(cost, plan, stage: int) -> float:
    """Parameters one rank of `stage` exchanges: its shard (tp, FSDP's dp) or its replica's slice."""
    st = plan.stages[stage]
    return cost.stage_params(st.units) / plan.stage_tp(stage) / plan.dp


def exchange_bytes(cost, plan) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], int]]:
    """Per WAN link direction, the bytes one exchange of one fragment moves, and how many ranks
    send them at once (`cost`: the CostModel counting each stage's parameters)."""
    o = plan.outer
    k = o.num_workers
    by_dir: dict[tuple[str, str], float] = {}
    flows: dict[tuple[str, str], int] = {}
    for s in range(plan.pp):
        n = rank_numel(cost, plan, s) / o.fragments
        per_pair = 2 * outer_wire_bytes(int(n / k), o.compression)      # its part one way, the mean back
        ranks = plan.dp * plan.stage_tp(s)
        for a in range(k):
            for b in range(k):
                src, dst = o.workers[a][s], o.workers[b][s]
                if a != b and src != dst:
                    by_dir[(src, dst)] = by_dir.get((src, dst), 0.0) + ranks * per_pair
                    flows[(src, dst)] = flows.get((src, dst), 0) + ranks
    return by_dir, flows


def outer_cost(costs, plan, inner_step_s: float) -> OuterCost:
    """The outer exchange of DiLoCo plan `plan` (its StageCosts `costs`), given the workers' inner
    step time (what an overlapped exchange hides behind)."""
    o = plan.outer
    if o.num_workers < 2:
        return OuterCost(0.0)
    by_dir, flows = exchange_bytes(costs.base, plan)
    opt = max(costs.optimizer(st.units, st.dc, plan.sharding, plan.dp, plan.stage_tp(s))
              for s, st in enumerate(plan.stages)) / o.fragments
    slowest, rtt = 0.0, 0.0
    for (a, b), nbytes in by_dir.items():
        link = costs.link(a, b)
        one = link.rate_gbps(o.connections)
        slots = turn_slots(o.sharing, link.capacity_gbps, one, flows[(a, b)])     # temporal: turns taken
        rate = min(link.capacity_gbps, (slots or flows[(a, b)]) * one) * GBIT
        turns = TURN_OVERHEAD_S * flows[(a, b)] * 2 * (o.num_workers - 1) / slots if slots else 0.0
        lat = link.latency_ms * 1e-3
        slowest = max(slowest, 2 * lat + nbytes / rate + 2 * lat + turns)
        rtt = max(rtt, 2 * lat)
    exchange = slowest + STORE_ROUND_TRIPS * rtt
    exposed = max(0.0, exchange - o.overlap * inner_step_s)
    per_sync = o.fragments / o.inner_steps          # exchanges per inner step
    return OuterCost(exchange, by_dir, opt, exposed, per_sync * (exposed + opt),
                     {d: b * per_sync for d, b in by_dir.items()})
