"""What a stage's actions and transfers cost: the one interface the simulator, the planner's
scoring, calibration and link-sharing read.

`StageCosts` answers two kinds of question. Plan-free ones describe a stage by what prices it --
its units, DC, GPU type, tensor-parallel degree, micro-batch, checkpointing --, so the planner can
ask about layouts it never builds: compute per action kind (`compute`: forward, backward, its
input/weight split, recompute included), the TP all-reduces (`tp_comm`), the DP sync
(`dp_sync`), the optimizer step, the tied embedding's gradient sum, boundary bytes, an intra-DC
transfer, the receiver's TP all-gather and a WAN direction's terms (`wan`: rates, latency, ACK
wait, turn overhead -- the turn rule is `transport.turns.turn_slots`). Plan hooks (`stage_compute`,
`stage_sync`, `stage_optimizer`) price one stage of a plan from them, and `plan_inputs` assembles a
plan's simulator inputs: the only place that does, for every implementation.

This class is the analytic implementation: compute from `costs.CostModel` (FLOP estimate, or
measured per-unit times through its profile) on the DC's GPU, collectives from `costs.comm` over
the cluster. The calibrated one (calibrate.calibrated_costs.CalibratedCosts) subclasses it and
overrides only what a profile measures, so what both model (TP terms, the tied sum, the turn
rule) cannot drift apart. A finer compute model plugs in by overriding `compute`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from geotrain.costs import CostModel, StageTimes, comm
from geotrain.errors import GeotrainError
from geotrain.layout.wan_bytes import boundary_message_bytes
from geotrain.spec.cluster import Cluster, Datacenter, WanLink
from geotrain.transport.turns import TURN_OVERHEAD_S, turn_slots

GBIT = 1e9 / 8   # bytes/s per Gbit/s


@dataclass
class StageCost:
    """Per VIRTUAL stage, seconds per micro-batch and bytes: what the simulator runs."""

    forward: float
    backward: float
    backward_input: float
    backward_weight: float
    send_bytes: int   # activation bytes sent to the next virtual stage per micro-batch (gradient back: same size)


@dataclass(frozen=True)
class WanTerms:
    """One direction of a WAN link as a plan uses it (rates in Gbit/s, as the spec gives them)."""

    capacity_gbps: float
    flow_gbps: float     # one transfer: min(copies x its connections' rate, capacity)
    latency: float       # one-way, s
    ack_s: float         # from a transfer's last byte leaving until its sender holds the receiver's ACK
    turn_s: float        # what each turn costs beyond its bytes (0 where the pipelines take no turns)

    @property
    def capacity(self) -> float:
        return self.capacity_gbps * GBIT

    @property
    def flow_rate(self) -> float:
        return self.flow_gbps * GBIT


@dataclass(frozen=True)
class NormExchange:
    """What the gradient norm's exchange costs (`StageCosts.norm_exchange`): per physical stage its
    one-scalar all-reduce; hop[s] the delivery time of one scalar between stages s and s + 1."""

    reduce: list[float]
    hop: list[float]


@dataclass
class PlanInputs:
    """A plan's simulator inputs: per virtual stage its compute and send bytes, per physical stage
    its DP sync (the tied sum included) and optimizer step; `costs` prices its transfers."""

    stage_costs: list[StageCost]
    allreduce: list[float]
    optimizer: list[float]
    costs: StageCosts


class StageCosts:
    """Analytic costs (see the module docstring). `cost`: the CostModel under any checkpointing
    mode (each stage gets its own); None prices transfers only (a simulation of explicit compute
    times, `sim.simulate_costs`); `cluster`: the GPUs, DCs and links."""

    def __init__(self, cost: CostModel | None, cluster: Cluster):
        self.base, self.cluster = cost, cluster
        self._dcs = {d.name: d for d in cluster.datacenters}
        self._links: dict[tuple[str, str], WanLink | None] = {}

    @classmethod
    def for_plan(cls, spec, plan, cost: CostModel | None = None) -> StageCosts:
        """The spec's costs at the plan's precision (`cost` instead, when given)."""
        if cost is None:
            cost = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing,
                             optimizer=spec.job.optimizer, ep=plan.ep)
        return cls(cost, spec.cluster)

    # -- lookups ------------------------------------------------------------------------------
    def cost(self, checkpointing: str) -> CostModel:
        return self.base.with_checkpointing(checkpointing)

    def dc(self, name: str) -> Datacenter:
        return self._dcs[name]

    def link(self, a: str, b: str) -> WanLink | None:
        """The link joining a and b (memoised: the planner asks for the same pairs many times)."""
        hit = self._links.get((a, b), False)
        if hit is False:
            hit = self._links[(a, b)] = self.cluster.link(a, b)
        return hit

    # -- compute, per micro-batch on one GPU (TP rank) of a stage -----------------------------
    def compute(self, units: Sequence[int], gpu_type: str, micro_batch: int, tp: int,
                checkpointing: str) -> StageTimes:
        """Forward, backward and its input/weight split (recompute included), TP communication not."""
        return self.cost(checkpointing).stage_times(units, self.cluster.gpu(gpu_type), micro_batch, tp)

    def tp_comm(self, units: Sequence[int], micro_batch: int, tp: int, dc: str) -> float:
        """The Megatron TP all-reduces of a micro-batch, forward and backward (half each), and a
        MoE block's expert-parallel all-to-alls (inside the stage's DC)."""
        if tp <= 1 and self.base.ep <= 1:
            return 0.0
        return self.base.tp_comm_time(units, micro_batch, tp, self.dc(dc))

    # -- per iteration --------------------------------------------------------------------------
    def dp_sync(self, chunks: Sequence[Sequence[int]], spread: list[tuple[str, int]], sharding: str,
                microbatches: int, tp: int) -> float:
        """A stage's DP sync (every collective FSDP2 runs) over its replicas, `spread` (DC,
        replicas): inside one DC, or across a region's DCs (costs.comm.region_sync_time)."""
        if sum(n for _, n in spread) <= 1:
            return 0.0
        collectives = self.base.sync_collectives(chunks, sharding, microbatches, tp)
        return comm.region_sync_time(collectives, spread, self.dc, self.link, tp)

    def optimizer(self, units: Sequence[int], dc: str, sharding: str, dp: int, tp: int) -> float:
        return self.base.optimizer_time(units, self.cluster.gpu(self.dc(dc).gpu_type), sharding, dp, tp)

    def tied_sum(self, stage_dcs: Sequence[str], end_tps: tuple[int, int], sharding: str, dp: int) -> float:
        """The tied embedding's gradient sum between a pipeline's first and last stage per
        iteration, one pair per (replica, TP index) on both ends (0: untied, or one stage)."""
        pairs = dp * min(end_tps)
        return comm.pipeline_tied_sum_time(self.base.tied_grad_bytes(sharding, dp), pairs, stage_dcs, self.dc,
                                           self.link)

    def norm_exchange(self, plan) -> NormExchange:
        """The global gradient norm's exchange before each optimizer step (runtime.recipe.GradNorm,
        clipping on in bf16/fp32): per stage a one-scalar all-reduce over its dp x tp ranks (a tree:
        2 log2 latencies inside the DC, and across a region plan's DCs); then the stages' sums go
        down the pipeline to stage 0 and the total back up, one 8-byte message per neighbour pair
        and direction, delivered after that boundary's one-way latency (no bandwidth to speak of)."""
        pp = plan.pp
        dcs = [st.dc for st in plan.stages]
        reduce = []
        for s in range(pp):
            n = plan.dp * plan.stage_tp(s)
            places = [d for d, _ in plan.replicas_per_dc()] if plan.replica_dcs else [dcs[s]]
            k = len(places)             # a tree: up and down, its levels inside a DC, then across the DCs
            inside = 2 * math.ceil(math.log2(max(1, n // k))) * max(self._latency(a, a) for a in places)
            across = 2 * math.ceil(math.log2(k)) * max((self._latency(a, b) for a in places for b in places
                                                        if a != b), default=0.0)
            reduce.append(inside + across if n > 1 else 0.0)
        return NormExchange(reduce, [self._latency(dcs[s], dcs[s + 1]) for s in range(pp - 1)])

    def _latency(self, a: str, b: str) -> float:
        """One-way latency from DC a to b over the link joining them (inside a DC: its own)."""
        if a == b:
            return self.dc(a).intra_dc_latency_us * 1e-6
        link = self.link(a, b)
        if link is None:
            raise GeotrainError(f"datacenters {a} and {b} are not linked")
        return link.latency_ms * 1e-3

    # -- transfers --------------------------------------------------------------------------------
    def boundary_bytes(self, micro_batch: int) -> int:
        return self.base.boundary_bytes(micro_batch)

    def boundary_wire_bytes(self, plan, sender: int, receiver: int, nbytes: int) -> int:
        """A boundary message of `nbytes` from physical stage `sender` to `receiver` on the wire:
        every copy, compressed as the plan's link says (layout.wan_bytes.boundary_message_bytes).
        Without a cost model (explicit compute times) a link cannot be compressed: no hidden size."""
        if self.base is None:
            return nbytes * plan.boundary_copies(sender, receiver)
        return boundary_message_bytes(plan, sender, receiver, nbytes, self.base.dtype_bytes, self.base.model.hidden)

    def intra_transfer(self, dc: str, nbytes: float) -> float:
        d = self.dc(dc)
        return d.intra_dc_latency_us * 1e-6 + nbytes / (d.intra_dc_gbps * GBIT)

    def tp_gather(self, dc: str, nbytes: float, tp: int) -> float:
        """The receiver's all-gather of a scattered boundary tensor in its TP group (inside the node)."""
        d = self.dc(dc)
        return comm.ring_half(nbytes, tp, d.intra_node_gbps * GBIT, d.intra_dc_latency_us * 1e-6)

    def wan(self, a: str, b: str, connections: int, sharing: str, pipelines: int, copies: int = 1) -> WanTerms | None:
        """Direction a -> b of the link joining them (None: no link), each transfer `copies`
        parallel flows of `connections` connections. The sender holds the ACK one round trip after
        the last byte left (the transport completes a send on the receiver's ACK); turns cost
        their overhead only where the runtime takes them (per TP index's ring: one copy's flow)."""
        wl = self.link(a, b)
        if wl is None:
            return None
        ring = wl.rate_gbps(connections)
        turns = turn_slots(sharing, wl.capacity_gbps, ring, pipelines)
        return WanTerms(capacity_gbps=wl.capacity_gbps, flow_gbps=min(copies * ring, wl.capacity_gbps),
                        latency=wl.latency_ms * 1e-3, ack_s=2 * wl.latency_ms * 1e-3,
                        turn_s=TURN_OVERHEAD_S if turns else 0.0)

    # -- one stage of a plan ---------------------------------------------------------------------
    def stage_compute(self, plan, v: int) -> StageTimes:
        """Compute of the plan's virtual stage v, TP communication not included."""
        s = v % plan.pp
        a, b = plan.virtual_units()[v]
        return self.compute(range(a, b), self.dc(plan.stages[s].dc).gpu_type, plan.micro_batch, plan.stage_tp(s),
                            plan.stage_checkpointing(s))

    def stage_sync(self, plan, s: int, spread: list[tuple[str, int]] | None = None) -> float:
        """The DP sync of the plan's physical stage s (the tied sum not included); `spread`: a
        region plan's (DC, replicas), None for replicas in the stage's DC."""
        st = plan.stages[s]
        return self.dp_sync([range(a, b) for a, b in st.chunks], spread or [(st.dc, plan.dp)], plan.sharding,
                            plan.num_microbatches, plan.stage_tp(s))

    def stage_optimizer(self, plan, s: int) -> float:
        st = plan.stages[s]
        return self.optimizer(st.units, st.dc, plan.sharding, plan.dp, plan.stage_tp(s))

    def plan_tied_sum(self, plan) -> float:
        """The tied sum of the plan's pipelines, which its first and last stage add to their sync."""
        return self.tied_sum([st.dc for st in plan.stages], (plan.stage_tp(0), plan.stage_tp(plan.pp - 1)),
                             plan.sharding, plan.dp)


def with_tp_comm(forward: float, backward: float, backward_input: float, backward_weight: float,
                 tpc: float) -> tuple[float, float, float, float]:
    """A micro-batch's compute with its TP all-reduces `tpc`: half in the forward, half in the
    backward's input-gradient part (on the critical path). The simulator and the planner add them here."""
    half = tpc / 2
    return forward + half, backward + half, backward_input + half, backward_weight


def sync_spread(cluster: Cluster, plan) -> list[tuple[str, int]] | None:
    """(DC, replicas) a region plan's DP groups spread over, checked once against the cluster
    (named DCs, every pair linked); None for an ordinary plan (each stage's DP inside its DC)."""
    if not plan.replica_dcs:
        return None
    spread = plan.replicas_per_dc()
    names = [d for d, _ in spread]
    known = {d.name for d in cluster.datacenters}
    if any(n not in known for n in names):
        raise GeotrainError(f"plan {plan.name!r}: replica_dcs names {sorted(set(names) - known)}, not datacenters "
                            f"of cluster {cluster.name}")
    if any(cluster.link(a, b) is None for i, a in enumerate(names) for b in names[i + 1:]):
        raise GeotrainError(f"plan {plan.name!r} spreads DP over {', '.join(names)}, which are not all linked")
    return spread


def plan_inputs(costs: StageCosts, plan) -> PlanInputs:
    """The plan's simulator inputs from `costs`: per virtual stage its compute with the TP
    all-reduces and the bytes it sends on (the last sends nothing); per physical stage its DP sync
    and optimizer step, the first and the last stage also summing their tied embedding copies'
    gradients before the step."""
    pp, mb = plan.pp, plan.micro_batch
    last = pp * plan.virtual_per_stage - 1
    stage_costs = []
    for v, (a, b) in enumerate(plan.virtual_units()):
        s = v % pp
        tp = plan.stage_tp(s)
        tpc = costs.tp_comm(range(a, b), mb, tp, plan.stages[s].dc)
        t = costs.stage_compute(plan, v)
        f, bwd, b_in, b_w = with_tp_comm(t.forward, t.backward, t.backward_input, t.backward_weight, tpc)
        stage_costs.append(StageCost(forward=f, backward=bwd, backward_input=b_in, backward_weight=b_w,
                                     send_bytes=costs.boundary_bytes(mb) if v < last else 0))
    spread = sync_spread(costs.cluster, plan)
    allreduce = [costs.stage_sync(plan, s, spread) for s in range(pp)]
    optimizer = [costs.stage_optimizer(plan, s) for s in range(pp)]
    tied = costs.plan_tied_sum(plan)
    if tied:
        allreduce[0] += tied
        allreduce[-1] += tied
    return PlanInputs(stage_costs, allreduce, optimizer, costs)
