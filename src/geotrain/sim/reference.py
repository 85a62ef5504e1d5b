"""The simulator's specification: the obvious, slow algorithm the fast engine (engine.py) must match.

One global clock. At each instant every GPU ("unit": one stage replica; its TP group moves as
one) does all it can: a compute starts and occupies it for its duration (or, with a core pool,
shares the host's cores with every unit computing: k of them each progress at 1 / slowdown[k]); a
receive passes once its tensor has arrived (then, between stages of equal tp > 1, the TP group
all-gathers it); a send hands its tensor on -- inside a DC it arrives latency + bytes / bandwidth
later, over the WAN it joins its link, with p2p "blocking" it waits for its receive to be reached
and both go on when the transfer is done; an all-reduce starts once every replica of the stage is
there; the optimizer step waits until every WAN send of the GPU is acknowledged (and then for the
step-wide collective, where one is modelled). When nothing more
can happen at this instant, the WAN links admit waiting transfers, and the clock moves to the next
instant something changes: a compute or all-reduce ends, a tensor arrives, an ACK comes back, a
transfer's last byte leaves its link.

A WAN link direction: the transfers being sent share it, each at min(flow rate, capacity / how
many), and a flow's transfers ((sending unit, receiving unit)) go one after the other. Fair
sharing sends every flow's first transfer at once; temporal sharing lets at most `slots`
(transport.turns.concurrent_turns) send at once, the earliest ready first, ties in the plan's turn
order, each arriving its turn's overhead later. The last byte reaches the receiver one latency
after it left; the sender holds the ACK `ack_s` after it left.

The inputs are `simulate.simulate_costs`'s: per virtual stage compute and bytes, per stage sync and
optimizer time, and the StageCosts pricing every transfer; the schedule's actions are read as
they are, not through the engine's compiled program.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from geotrain.errors import GeotrainError
from geotrain.layout.stage_costs import StageCosts
from geotrain.schedule.actions import Op
from geotrain.transport.turns import concurrent_turns

COMPUTE = {Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.OPTIMIZER}
DONE_BYTES, DONE_WORK = 1e-6, 1e-12    # what counts as nothing left (float rounding of the steps)


@dataclass
class Transfer:
    sender: tuple[int, int]        # (stage, replica)
    flow: tuple                    # (sending unit, receiving unit)
    recv: tuple                    # the receive it completes
    left: float                    # bytes still to send
    rank: tuple                    # admission order: (ready time, turn order, joined)
    event: tuple
    started: float = 0.0


@dataclass
class Link:
    """One WAN direction; `slots` None under fair sharing."""

    capacity: float
    flow_rate: float
    latency: float
    ack_s: float
    slots: int | None
    turn_order: dict[int, int]
    sending: list[Transfer] = field(default_factory=list)
    waiting: list[Transfer] = field(default_factory=list)

    def rate(self) -> float:
        return min(self.flow_rate, self.capacity / len(self.sending))

    def admit(self, now: float) -> None:
        for t in sorted(self.waiting, key=lambda t: t.rank):
            flow_busy = any(x.flow == t.flow for x in self.sending)
            if not flow_busy and (self.slots is None or len(self.sending) < self.slots):
                self.waiting.remove(t)
                self.sending.append(t)
                t.started = now


def steps_of(plan, schedule, iterations: int) -> dict[tuple[int, int], list[tuple[int, str, object]]]:
    """Every unit's steps: its stage's actions each iteration, the optimizer preceded by the wait
    for its ACKs, a receive of a scattered boundary followed by the TP all-gather."""
    out = {}
    for s in range(plan.pp):
        steps = []
        for it in range(iterations):
            for a in schedule.actions[s]:
                if a.op == Op.OPTIMIZER:
                    steps.append((it, "acks", a))
                steps.append((it, "act", a))
                sender = a.peer % plan.pp
                if a.op in (Op.RECV_ACT, Op.RECV_GRAD) and sender != s and plan.boundary_scattered(sender, s):
                    steps.append((it, "gather", a))
        for d in range(plan.dp):
            out[(s, d)] = steps
    return out


def reference_events(plan, costs: StageCosts, schedule, stage_costs, allreduce, optimizer, iterations: int = 1,
                     core_slowdown=None, blocking: bool = False,
                     step_sync: list[float] | None = None) -> dict[tuple, tuple[float, float]]:
    """(start, end) of every compute, all-reduce and transfer: computes and all-reduces keyed
    (stage, replica, kind, virtual stage, micro-batch, iteration), transfers (stage, replica,
    "transfer", sending virtual stage, micro-batch, iteration, receiving stage); a WAN transfer
    starts when its bytes start to flow."""
    pp, dp = plan.pp, plan.dp
    todo = steps_of(plan, schedule, iterations)
    units = sorted(todo)
    pos = dict.fromkeys(units, 0)
    offsets = (list(plan.pipeline_offsets) + [0.0] * dp)[:dp]
    busy_until = {u: offsets[u[1]] for u in units}   # its compute, all-reduce or blocking send ends
    computing: dict[tuple, list] = {}            # with a core pool: unit -> [work left, event, start]
    arrival: dict[tuple, float] = {}             # receive -> when its tensor arrives
    offers: dict[tuple, tuple] = {}              # receive -> its blocking sender (unit, duration, event)
    unacked, acked = dict.fromkeys(units, 0), dict.fromkeys(units, 0.0)
    reached: dict[tuple, dict[int, float]] = {}  # (stage, iteration) -> replicas at its all-reduce
    links: dict[str, Link] = {}
    events: dict[tuple, tuple[float, float]] = {}
    joined = [0]

    def link(a: str, b: str, copies: int) -> Link:
        name = f"{a}->{b}"
        if name not in links:
            lp = plan.link_between(a, b)
            w = costs.wan(a, b, lp.connections, lp.sharing, dp, copies)
            slots = concurrent_turns(w.capacity, w.flow_rate) if lp.sharing == "temporal" else None
            links[name] = Link(w.capacity, w.flow_rate, w.latency + w.turn_s, w.ack_s, slots,
                               {r: i for i, r in enumerate(lp.order)})
        return links[name]

    def compute(u, now: float, dur: float, event) -> None:
        if core_slowdown is not None:
            computing[u] = [dur, event, now]
        else:
            busy_until[u] = now + dur
            if event is not None:
                events[event] = (now, now + dur)

    def step(u, now: float) -> bool:
        """Unit u does its next step at `now` if it can; whether it did."""
        (s, d), i = u, pos[u]
        if i >= len(todo[u]) or busy_until[u] > now or u in computing:
            return False
        it, what, a = todo[u][i]
        recv = (d, a.op == Op.RECV_ACT, a.peer, a.stage, a.mb, it)           # a receive's key
        if what == "acks":
            if unacked[u] or acked[u] > now:
                return False
            busy_until[u] = now + (step_sync[s] if step_sync else 0.0)    # then the step-wide collective
        elif what == "gather":
            src = a.peer if a.op == Op.RECV_ACT else a.stage
            compute(u, now, costs.tp_gather(plan.stages[s].dc, stage_costs[src].send_bytes, plan.stage_tp(s)), None)
        elif a.op in COMPUTE:
            dur = optimizer[s] if a.op == Op.OPTIMIZER else getattr(stage_costs[a.stage], a.op.value)
            compute(u, now, dur, (s, d, a.op.value, a.stage, a.mb, it))
        elif a.op == Op.ALLREDUCE:
            there = reached.setdefault((s, it), {})
            if d in there:
                return False
            there[d] = now
            if len(there) < dp:
                pos[u] -= 1                      # stays here; the last replica to come starts it for all
            else:
                for r in range(dp):
                    events[(s, r, "allreduce", a.stage, a.mb, it)] = (now, now + allreduce[s])
                    busy_until[(s, r)] = now + allreduce[s]
                    pos[(s, r)] += r != d
        elif a.op in (Op.RECV_ACT, Op.RECV_GRAD):
            if recv not in arrival and recv in offers:     # its blocking sender waits: the transfer starts now
                w, dur, event = offers.pop(recv)
                arrival[recv] = busy_until[w] = now + dur
                events[event] = (now, now + dur)
                pos[w] += 1
            if arrival.get(recv, now + 1.0) > now:
                return False
        elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
            to = a.peer % pp
            recv = (d, a.op == Op.SEND_ACT, a.stage, a.peer, a.mb, it)
            if to == s:                          # to the same GPU
                arrival[recv] = now
            else:
                event = (s, d, "transfer", a.stage, a.mb, it, to)
                nbytes = stage_costs[a.stage if a.op == Op.SEND_ACT else a.peer].send_bytes
                flows = plan.stage_tp(to)                  # one flow to each receiving TP rank
                a_dc, b_dc = plan.stages[s].dc, plan.stages[to].dc
                if a_dc == b_dc:                           # the flows leave from different GPUs at once
                    nbytes *= plan.boundary_copies(s, to)  # one tensor in all if scattered, else a copy per flow
                    dur = costs.intra_transfer(a_dc, nbytes // flows)
                    if blocking:
                        if recv not in offers:
                            offers[recv] = (u, dur, event)
                            return True
                        return False                       # waits for its receive
                    arrival[recv] = now + dur
                    events[event] = (now, now + dur)
                else:                                      # every copy, compressed where the link plan says
                    nbytes = costs.boundary_wire_bytes(plan, s, to, nbytes)
                    ln = link(a_dc, b_dc, flows)
                    joined[0] += 1
                    rank = (now, ln.turn_order.get(d, len(ln.turn_order) + d), joined[0])
                    ln.waiting.append(Transfer(u, (u, (to, d)), recv, nbytes, rank, event))
                    unacked[u] += 1
        else:
            raise GeotrainError(f"the reference has no rule for {a}")
        pos[u] += 1
        return True

    now = 0.0
    while True:
        moved = True
        while moved:                             # everything that can happen at `now`
            moved = False
            for u in units:
                while step(u, now):
                    moved = True
        for ln in links.values():                # then the links admit what is ready
            ln.admit(now)
        # The next instant something changes, and what is sent and computed until then.
        rate = 1.0 / core_slowdown[min(len(computing), len(core_slowdown) - 1)] if computing else 0.0
        times = [t for t in busy_until.values() if t > now]
        times += [t for t in arrival.values() if t > now] + [t for t in acked.values() if t > now]
        times += [now + min(t.left for t in ln.sending) / ln.rate() for ln in links.values() if ln.sending]
        times += [now + min(w for w, _, _ in computing.values()) / rate] if computing else []
        if not times:
            break
        nxt = min(times)
        for ln in links.values():
            r = ln.rate() if ln.sending else 0.0
            for t in ln.sending:
                t.left -= r * (nxt - now)
        for job in computing.values():
            job[0] -= (nxt - now) * rate
        now = nxt
        for ln in links.values():                # transfers whose last byte left
            for t in [t for t in ln.sending if t.left <= DONE_BYTES]:
                ln.sending.remove(t)
                arrival[t.recv] = now + ln.latency
                events[t.event] = (t.started, now + ln.latency)
                unacked[t.sender] -= 1
                acked[t.sender] = max(acked[t.sender], now + ln.ack_s)
        for u, (work, event, start) in list(computing.items()):    # pooled computes whose work is done
            if work <= DONE_WORK:
                del computing[u]
                if event is not None:
                    events[event] = (start, now)
    stuck = [u for u in units if pos[u] < len(todo[u])]
    if stuck:
        raise GeotrainError(f"the reference deadlocks: {len(stuck)} GPUs never finish (first: {stuck[0]})")
    return events


def iteration_time(events: dict[tuple, tuple[float, float]], iterations: int) -> float:
    """Mean over iterations of (last optimizer end - first training compute start), as trace.metrics."""
    first, last = [float("inf")] * iterations, [-float("inf")] * iterations
    for key, (start, end) in events.items():
        kind, it = key[2], key[5]
        if kind in ("forward", "backward", "backward_input", "backward_weight"):
            first[it] = min(first[it], start)
        if kind == "optimizer":
            last[it] = max(last[it], end)
    return sum(b - a for a, b in zip(first, last)) / iterations
