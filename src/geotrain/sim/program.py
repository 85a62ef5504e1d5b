"""Compile a schedule into flat per-stage programs the engine can run fast.

Every DP replica of a physical stage runs the same action list, so a stage's list is compiled
once into parallel Python lists (integer op codes, durations, send targets), repeated for each
iteration. A send knows, precomputed, the receiving stage, the index of the matching receive in
that stage's program (its "slot") and the link it crosses, so delivering a tensor is a list store.
Boundaries between stages of different tensor-parallel degrees are priced as the runtime moves
them (`compile_program` says how).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from geotrain.errors import InfeasibleError
from geotrain.layout.plan import LinkPlan, Plan
from geotrain.layout.stage_costs import NormExchange, StageCosts
from geotrain.schedule.actions import Op, Schedule
from geotrain.trace.metrics import KIND_CODE

# Engine op codes.
COMPUTE = 0      # occupies the GPU for dur
RECV = 1         # blocks until the slot's tensor arrived
SEND_LOCAL = 2   # to the same GPU (interleaving with pp=1): instantaneous
SEND_INTRA = 3   # inside a DC: arrives after dur = latency + bytes / bandwidth (no contention)
SEND_WAN = 4     # queued on a WAN link direction (fair or temporal sharing)
ALLREDUCE = 5    # DP collective: starts when every replica of the stage reached it
WAIT_ACKS = 6    # before the optimizer step: until every WAN send so far is acknowledged (see below), then dur
COMPUTE_POOLED = 7  # the engine's, with a core pool: a COMPUTE that needs a core (sim.cores)
SEND_SYNC = 8    # inside a DC, blocking (p2p="blocking"): a rendezvous with the receive, then dur for both

GBPS = 1e9 / 8   # bytes/s per Gbit/s

_COMPUTE_OPS = {Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.OPTIMIZER}


@dataclass(frozen=True)
class WanDirection:
    """One direction of a WAN link, as the plan uses it."""

    name: str            # "A->B"
    capacity: float      # bytes/s
    flow_rate: float     # bytes/s one transfer can reach: min(n x per-connection cap, capacity)
    latency: float       # one-way, s
    sharing: str         # "fair" | "temporal"
    priority: tuple[int, ...]  # per DP replica: rank in the link plan's order (temporal tie-break)
    ack_s: float = 0.0   # from a transfer's last byte leaving until its sender holds the receiver's ACK
    turn_s: float = 0.0  # temporal: what each turn costs beyond its bytes (transport.turns.TURN_OVERHEAD_S)


@dataclass
class StageProgram:
    ops: list[int] = field(default_factory=list)
    dur: list[float] = field(default_factory=list)      # compute/allreduce time; intra-DC send: transfer time
    kind: list[int] = field(default_factory=list)       # trace kind code (metrics.KINDS), -1: none
    vstage: list[int] = field(default_factory=list)
    mb: list[int] = field(default_factory=list)
    iteration: list[int] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    dst_stage: list[int] = field(default_factory=list)  # send: receiving physical stage, else -1
    dst_slot: list[int] = field(default_factory=list)   # send: index of the matching recv there, else -1
    link: list[int] = field(default_factory=list)       # send: index into Program.link_names, else -1
    wan: list[int] = field(default_factory=list)        # WAN send: index into Program.wan, else -1

    def __len__(self) -> int:
        return len(self.ops)


@dataclass
class Program:
    stages: list[StageProgram]
    dp: int
    link_names: list[str]
    wan: list[WanDirection]
    link_meta: dict[str, dict[str, float | str]]


def _wan_direction(costs: StageCosts, plan: Plan, a: str, b: str, copies: int = 1) -> WanDirection:
    lp = plan.link_between(a, b) or LinkPlan(src_dc=a, dst_dc=b)
    # `copies` parallel flows (one per receiving TP rank), each on its own connections.
    w = costs.wan(a, b, lp.connections, lp.sharing, plan.dp, copies)
    if w is None:
        raise InfeasibleError(f"the schedule sends between datacenters {a} and {b}, which no WAN link joins")
    if lp.sharing not in ("fair", "temporal"):
        raise InfeasibleError(f"link {a}-{b}: unknown sharing {lp.sharing!r} (known: fair, temporal)")
    order = {d: i for i, d in enumerate(lp.order)}
    prio = tuple(order.get(d, len(order) + d) for d in range(plan.dp))
    return WanDirection(name=f"{a}->{b}", capacity=w.capacity, flow_rate=w.flow_rate, latency=w.latency,
                        sharing=lp.sharing, priority=prio, ack_s=w.ack_s, turn_s=w.turn_s)


def _norm_sends(p: StageProgram, s: int, v: int, it: int, pp: int, norm: NormExchange, sends: list,
                recv_slot: dict) -> None:
    """Stage s's scalar all-reduce, then the partial sum: from stage s + 1, on to s - 1."""
    if norm.reduce[s] > 0:
        _append(p, ALLREDUCE, norm.reduce[s], -1, v, -1, it, 0)
    if s < pp - 1:
        recv_slot[(2, s + 1, s, -1, it)] = s * (1 << 40) + len(p.ops)
        _append(p, RECV, 0.0, KIND_CODE["recv_wait"], v, -1, it, 0)
    if s > 0:
        sends.append((s, len(p.ops), 2, s - 1, it))
        _append(p, SEND_INTRA, norm.hop[s - 1], -1, v, -1, it, 8)


def _norm_recvs(p: StageProgram, s: int, v: int, it: int, pp: int, norm: NormExchange, sends: list,
                recv_slot: dict) -> None:
    """Stage s takes the total from stage s - 1 and passes it on to s + 1."""
    if s > 0:
        recv_slot[(3, s - 1, s, -1, it)] = s * (1 << 40) + len(p.ops)
        _append(p, RECV, 0.0, KIND_CODE["recv_wait"], v, -1, it, 0)
    if s < pp - 1:
        sends.append((s, len(p.ops), 3, s + 1, it))
        _append(p, SEND_INTRA, norm.hop[s], -1, v, -1, it, 8)


def _append(p: StageProgram, code: int, dur: float, kind: int, v: int, mb: int, it: int, nb: int) -> None:
    p.ops.append(code)
    p.dur.append(float(dur))
    p.kind.append(kind)
    p.vstage.append(v)
    p.mb.append(mb)
    p.iteration.append(it)
    p.nbytes.append(int(nb))
    p.dst_stage.append(-1)
    p.dst_slot.append(-1)
    p.link.append(-1)
    p.wan.append(-1)


def compile_program(plan: Plan, costs: StageCosts, schedule: Schedule, stage_costs: list, allreduce_time: list[float],
                    optimizer_time: list[float], iterations: int, blocking: bool = False,
                    step_sync: list[float] | None = None, norm: NormExchange | None = None) -> Program:
    """Tensor parallelism at a boundary: a stage's output (and input gradient) is whole and replicated
    on its TP ranks. Between stages of the same tp > 1 the runtime moves it Megatron's way
    (Plan.boundary_scattered): TP rank t sends slice t to TP rank t, the receiver all-gathers inside
    the node -- tp parallel flows carrying one tensor in all, each receive followed by the gather
    (costs.comm.ring_half over intra_node_gbps). Where the tps differ, receiving TP rank t' takes the
    whole tensor from sending rank t' mod tp_sender (runtime/p2p.py's pairing): one copy per
    receiving rank, as that many parallel flows (Plan.boundary_copies); inside a DC one copy's time.

    `costs` prices the transfers (intra-DC, WAN directions with their ACK wait, TP gathers);
    each OPTIMIZER is preceded by a WAIT_ACKS slot. `blocking`: sends between stages are blocking
    rendezvous (SEND_SYNC, a runtime with blocking NCCL send/recv such as DeepSpeed's pipe engine):
    sender and receiver both wait until the other side is there and the transfer is done.
    `step_sync`: per physical stage, a wait of that many seconds at the WAIT_ACKS slot -- the
    runtime's step-wide collective before the optimizer, as a calibration measured it
    (calibrate.waits.global_sync_s). `norm` (clipping on, analytic): before each OPTIMIZER the
    gradient norm's exchange (runtime.recipe.GradNorm) -- the stage's scalar all-reduce, the partial
    sum from the next stage received and passed on to the previous one before the WAIT_ACKS, then the
    total from the previous stage received and passed on after it; each scalar delivered after
    norm.hop, no link contention (8 bytes)."""
    pp, vps = plan.pp, schedule.virtual_per_stage
    if schedule.num_stages != pp:
        raise ValueError(f"schedule has {schedule.num_stages} stages, plan has {pp}")
    if len(stage_costs) != pp * vps:
        raise ValueError(f"need one StageCost per virtual stage ({pp * vps}), got {len(stage_costs)}")
    if len(allreduce_time) != pp or len(optimizer_time) != pp:
        raise ValueError(f"need one allreduce and one optimizer time per physical stage ({pp})")
    dcs = [st.dc for st in plan.stages]
    link_names: list[str] = []
    link_id: dict[str, int] = {}
    wan: list[WanDirection] = []
    wan_id: dict[str, int] = {}
    meta: dict[str, dict[str, float | str]] = {}

    def link_of(a: str, b: str, copies: int) -> tuple[int, int]:
        name = a if a == b else f"{a}->{b}"
        if name not in link_id:
            link_id[name] = len(link_names)
            link_names.append(name)
            if a == b:
                dc = costs.dc(a)
                meta[name] = {"kind": "intra", "bandwidth_Bps": dc.intra_dc_gbps * GBPS,
                              "latency_s": dc.intra_dc_latency_us * 1e-6}
            else:
                w = _wan_direction(costs, plan, a, b, copies)
                wan_id[name] = len(wan)
                wan.append(w)
                meta[name] = {"kind": "wan", "capacity_Bps": w.capacity, "flow_rate_Bps": w.flow_rate,
                              "latency_s": w.latency, "sharing": w.sharing}
        return link_id[name], wan_id.get(name, -1)

    progs = [StageProgram() for _ in range(pp)]
    # Pass 1: lay out every stage's program and index its receives.
    recv_slot: dict[tuple[bool, int, int, int, int], int] = {}  # (is_act, from_v, to_v, mb, it) -> slot
    pending_sends: list[tuple[int, int, bool, int, int, int, int]] = []
    norm_sends: list[tuple[int, int, int, int, int]] = []   # (stage, slot, 2 partial | 3 total, to stage, it)
    for s, acts in enumerate(schedule.actions):
        p = progs[s]
        for it in range(iterations):
            for a in acts:
                op, v = a.op, a.stage
                if op == Op.OPTIMIZER:
                    if norm is not None:        # the partial leaves before the boundary sends' ACKs
                        _norm_sends(p, s, v, it, pp, norm, norm_sends, recv_slot)
                    _append(p, WAIT_ACKS, step_sync[s] if step_sync else 0.0, -1, v, a.mb, it, 0)
                    if norm is not None:
                        _norm_recvs(p, s, v, it, pp, norm, norm_sends, recv_slot)
                slot = len(p.ops)
                code, dur, kind, nb = COMPUTE, 0.0, -1, 0
                if op in _COMPUTE_OPS:
                    kind = KIND_CODE[op.value]
                    if op == Op.OPTIMIZER:
                        dur = optimizer_time[s]
                    else:
                        dur = getattr(stage_costs[v], op.value)
                elif op == Op.ALLREDUCE:
                    code, dur, kind = ALLREDUCE, allreduce_time[s], KIND_CODE["allreduce"]
                elif op in (Op.RECV_ACT, Op.RECV_GRAD):
                    code, kind = RECV, KIND_CODE["recv_wait"]
                    key = (op == Op.RECV_ACT, a.peer, v, a.mb, it)
                    if key in recv_slot:
                        raise ValueError(f"stage {s}: duplicate {a} in iteration {it}")
                    recv_slot[key] = s * (1 << 40) + slot
                    sender = a.peer % plan.pp
                    if sender != s and plan.boundary_scattered(sender, s):
                        # the receiver all-gathers the 1/tp slices in its TP group before the tensor is whole
                        src_v = a.peer if op == Op.RECV_ACT else v
                        gather = costs.tp_gather(dcs[s], stage_costs[src_v].send_bytes, plan.stage_tp(s))
                        _append(p, RECV, 0.0, kind, v, a.mb, it, 0)
                        code, dur = COMPUTE, gather
                elif op in (Op.SEND_ACT, Op.SEND_GRAD):
                    code, kind = SEND_INTRA, KIND_CODE["transfer"]
                    # Activation of v and its gradient have the same size: v's output for acts, v-1's for grads.
                    nb = stage_costs[v].send_bytes if op == Op.SEND_ACT else stage_costs[a.peer].send_bytes
                    pending_sends.append((s, slot, op == Op.SEND_ACT, v, a.peer, a.mb, it))
                else:
                    raise ValueError(f"the simulator has no duration for {a} (op {op.value})")
                _append(p, code, dur, kind, v, a.mb, it, nb)
    for s, slot, what, j, it in norm_sends:                 # the norm's scalars: no link, only latency
        packed = recv_slot.pop((what, s, j, -1, it))
        progs[s].dst_stage[slot], progs[s].dst_slot[slot] = packed >> 40, packed & ((1 << 40) - 1)
    # Pass 2: resolve every send to its receive and link.
    for s, slot, is_act, v, peer, mb, it in pending_sends:
        key = (is_act, v, peer, mb, it)
        if key not in recv_slot:
            what = "activation" if is_act else "gradient"
            raise ValueError(f"stage {s} sends the {what} of micro-batch {mb} to virtual stage {peer}, "
                             f"which never receives it")
        packed = recv_slot.pop(key)
        ds, dslot = packed >> 40, packed & ((1 << 40) - 1)
        p = progs[s]
        p.dst_stage[slot], p.dst_slot[slot] = ds, dslot
        if ds == s:
            p.ops[slot], p.kind[slot] = SEND_LOCAL, -1
            continue
        a, b = dcs[s], dcs[ds]
        flows = plan.stage_tp(ds)   # one flow to each receiving TP rank (see the module docstring)
        lid, wid = link_of(a, b, flows)
        p.link[slot] = lid
        if wid >= 0:     # every copy (one tensor if scattered), compressed where the link plan says
            p.nbytes[slot] = costs.boundary_wire_bytes(plan, s, ds, p.nbytes[slot])
        else:
            p.nbytes[slot] = p.nbytes[slot] * plan.boundary_copies(s, ds)
        one = p.nbytes[slot] // flows                                   # what each flow carries
        if wid >= 0:
            if blocking:
                raise InfeasibleError(f"blocking P2P across the WAN ({a} -> {b}) is not modelled")
            p.ops[slot], p.wan[slot] = SEND_WAN, wid
        else:   # the flows leave from different GPUs in parallel: one flow's time
            p.dur[slot] = costs.intra_transfer(a, one)
            if blocking:
                p.ops[slot] = SEND_SYNC
    if recv_slot:
        (is_act, frm, to, mb, it), _ = next(iter(recv_slot.items()))
        what = "activation" if is_act else "gradient"
        raise ValueError(f"virtual stage {to} waits for the {what} of micro-batch {mb} from {frm}, "
                         "which never sends it")
    return Program(stages=progs, dp=plan.dp, link_names=link_names, wan=wan, link_meta=meta)
