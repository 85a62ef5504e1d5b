"""The discrete-event engine: runs every GPU's program against the links.

Why it is fast: a GPU's timeline depends only on its own compute, on when its inputs arrive and
on its DP collectives -- not on a global clock. So each unit (one stage replica; its tp group
moves as one) runs ahead over its program's op codes (sim.program) until a receive whose tensor
has not arrived or an all-reduce its replicas have not all reached. Intra-DC sends have a known
arrival time and are delivered at once; only WAN transfers, whose finish depends on what shares
the link, go through a time-ordered heap (sim.links). The loop: run every woken unit ahead, pop
the next event, hand it to its kind's handler. It is exact: a unit only runs when woken by
something at or before its clock, so nothing is pushed into the heap's past. sim/reference.py is
the slow, obvious specification it must match (tests/test_sim_reference.py); `Engine` documents
ties, the blocking ops and what is recorded.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from heapq import heappop, heappush

from geotrain.errors import GeotrainError
from geotrain.sim.cores import CorePool
from geotrain.sim.links import FairLink, TemporalLink
from geotrain.sim.program import (
    ALLREDUCE,
    COMPUTE,
    COMPUTE_POOLED,
    RECV,
    SEND_INTRA,
    SEND_LOCAL,
    SEND_SYNC,
    SEND_WAN,
    WAIT_ACKS,
    Program,
)
from geotrain.transport.turns import concurrent_turns

# Kinds of heap event: (time, phase, seq, kind, x, y).
ARRIVE = 0       # a WAN send enters its link: x unit, y slot
FAIR_DONE = 1    # a link's predicted completion: x link, y its version then (stale when it moved on)
DISPATCH = 2     # a temporal link admits waiting transfers (phase 1): x link
CORE_START = 3   # a pooled compute starts: x unit, y slot
CORE_DONE = 4    # the pool's predicted completion: x its version then

# What a blocked unit waits for (`Engine.wait`); >= 0: the receive slot whose tensor it needs.
RUNNABLE, COLLECTIVE, ACKS, CORE, RENDEZVOUS = -1, -2, -3, -4, -5


@dataclass
class EngineResult:
    start: list[list[float]]    # per unit, per slot: start time (see module docstring)
    arrival: list[list[float]]  # per unit, per receive slot: arrival time of its tensor (-1: not a receive)
    actions: int                # actions executed (all units)
    wan_events: int             # events that went through the heap
    wall_s: float
    end: list[list[float]] | None = None  # with a core pool: per unit, per compute slot, its end time


def run_engine(prog: Program, offsets: list[float], progress: bool = False,
               cores: CorePool | None = None, unit_dur: list[list[float]] | None = None) -> EngineResult:
    """Run `prog` with DP replica d starting at offsets[d] (see the module docstring). `unit_dur`:
    per unit (stage * dp + replica), per slot, its own durations instead of its stage's -- a replay
    of measured compute, where every rank's every action took its own time (calibrate.replay);
    `end` then holds each slot's end."""
    return Engine(prog, offsets, cores, unit_dur).run(progress)


class Engine:
    """One run of a compiled program: its units' state, the links, the heap.

    Ties at one instant: link arrivals and completions first (phase 0), then temporal admissions
    (phase 1), so a free temporal link picks among *all* transfers ready then, by plan order.
    WAIT_ACKS: before its optimizer step a unit waits until every WAN send it made is acknowledged
    (delivery plus the direction's `ack_s`), then the slot's duration (the step-wide collective).
    SEND_SYNC (p2p "blocking"): a send and its receive meet -- the first there waits (a send leaves
    an offer keyed by the receive's (unit, slot)), the transfer starts at the later clock.
    COMPUTE_POOLED (a core pool, sim.cores): compute goes through the heap (CORE_START) and ends
    when the pool says (CORE_DONE, versioned like a fair link's completion).
    Recorded per unit and slot: when the action started (a receive: when the unit reached it; a WAN
    send: when it entered the link) and, per receive, when its tensor arrived -- the trace follows
    from these and the program; with a pool or `unit_dur` also each action's end."""

    def __init__(self, prog: Program, offsets: list[float], cores: CorePool | None = None,
                 unit_dur: list[list[float]] | None = None):
        self.t_wall = time.perf_counter()
        self.prog, self.cores, self.unit_dur = prog, cores, unit_dur
        self.dp = dp = prog.dp
        self.units = units = len(prog.stages) * dp
        length = [len(prog.stages[u // dp]) for u in range(units)]
        if unit_dur is not None and (len(unit_dur) != units or any(len(d) != n for d, n in zip(unit_dur, length))):
            raise ValueError("unit_dur needs one duration per slot of every unit's program")
        # Per stage: (op codes, durations, receiver's unit offset, receiver's slot, length); per unit
        # its stage's (the replicas share it), with its own durations under a replay.
        stages = [(p.ops if cores is None else [COMPUTE_POOLED if op == COMPUTE else op for op in p.ops],
                   p.dur, [(ds - s) * dp if ds >= 0 else 0 for ds in p.dst_stage], p.dst_slot, len(p))
                  for s, p in enumerate(prog.stages)]
        self.programs = [stages[u // dp] if unit_dur is None else stages[u // dp][:1] + (unit_dur[u],)
                         + stages[u // dp][2:] for u in range(units)]
        self.start = [[0.0] * n for n in length]
        self.box = [[-1.0] * n for n in length]      # a receive slot's arrival time, -1 until it arrives
        self.end = [[-1.0] * n for n in length] if cores is not None else None
        self.pcs = [0] * units
        self.clock = [float(offsets[u % dp]) if offsets else 0.0 for u in range(units)]
        self.wait = [RUNNABLE] * units
        self.unacked = [0] * units       # WAN sends not yet delivered
        self.acked = [0.0] * units       # when the latest delivered one's ACK reaches its sender
        self.ack_s = [w.ack_s for w in prog.wan]
        self.sends = [(p.wan, p.nbytes, st[2]) for p, st in zip(prog.stages, stages)]   # per stage: its WAN sends
        self.links = [FairLink(w.capacity, w.flow_rate, w.latency) if w.sharing == "fair"
                      else TemporalLink(w.flow_rate, w.latency, w.priority, w.capacity,
                                        concurrent_turns(w.capacity, w.flow_rate), w.turn_s)
                      for w in prog.wan]
        self.collectives: dict[int, list] = {}           # (stage, slot) -> [replicas arrived, latest clock]
        self.offers: dict[tuple[int, int], tuple] = {}   # blocking sends waiting for their receive
        self.heap: list[tuple] = []
        self.seq = itertools.count(1)                    # heap tie-break: push order
        self.stack = list(range(units - 1, -1, -1))      # units to run ahead
        self.executed = self.heap_events = 0
        self.state: tuple | None = None     # what run_ahead reads, while running

    def run(self, progress: bool = False) -> EngineResult:
        """Run woken units ahead; pop the next heap event, hand it to its kind's handler; repeat."""
        bar = _bar(sum(len(self.prog.stages[u // self.dp]) for u in range(self.units))) if progress else None
        on_event = self.event_handlers()
        heap, stack, events = self.heap, self.stack, 0
        self.state = (stack, self.box, self.start, self.pcs, self.clock, self.programs, self.dp, self.wait,
                      self.unacked, heap, self.seq, self.op_handlers(), self.offers)
        try:
            while True:
                if stack:
                    self.run_ahead()
                    if bar is not None and self.executed - bar.n > 65536:
                        bar.update(self.executed - bar.n)
                if not heap:
                    break
                now, _, _, kind, x, y = heappop(heap)
                events += 1
                on_event[kind](now, x, y)
        finally:
            self.state = None      # its handlers refer to the engine: no cycle left behind
        self.heap_events = events
        if bar is not None:
            bar.update(bar.total - bar.n)
            bar.close()
        self.check_finished()
        if self.unit_dur is not None and self.end is None:
            self.end = [[st + d for st, d in zip(self.start[u], self.unit_dur[u])] for u in range(self.units)]
        return EngineResult(start=self.start, arrival=self.box, actions=self.executed, wan_events=self.heap_events,
                            wall_s=time.perf_counter() - self.t_wall, end=self.end)

    # -- units ------------------------------------------------------------------------------------
    def run_ahead(self) -> None:
        """Run every woken unit ahead until it finishes or blocks: the hot loop, the common ops
        inline; an op that may block goes to its handler (`op_handlers`), which returns the unit's
        new clock, or None when the unit blocks there."""
        stack, box, start, pcs, clock, programs, dp, wait, unacked, heap, seq, on_op, offers = self.state
        executed = 0
        while stack:
            u = stack.pop()
            ops, dur, ddst, dslot, n = programs[u]
            pc = pc0 = pcs[u]
            t = clock[u]
            mst = start[u]
            mbox = box[u]
            while pc < n:
                op = ops[pc]
                if op == COMPUTE:
                    mst[pc] = t
                    t += dur[pc]
                elif op == RECV:
                    a = mbox[pc]
                    if a < 0.0:                            # not there yet: block, or meet a blocking send
                        if not offers or (u, pc) not in offers:
                            wait[u] = pc
                            break
                        a = on_op[RECV](u, pc, t)
                    mst[pc] = t
                    if a > t:
                        t = a
                elif op == SEND_INTRA:                     # arrives dur later: delivered now
                    mst[pc] = t
                    v = u + ddst[pc]
                    j = dslot[pc]
                    box[v][j] = t + dur[pc]
                    if wait[v] == j:
                        wait[v] = RUNNABLE
                        stack.append(v)
                elif op == SEND_WAN:                       # enters its link in time order
                    mst[pc] = t
                    unacked[u] += 1
                    heappush(heap, (t, 0, next(seq), ARRIVE, u, pc))
                elif op == SEND_LOCAL:                     # to the same GPU
                    mst[pc] = t
                    mbox[dslot[pc]] = t
                else:
                    t1 = on_op[op](u, pc, t)
                    if t1 is None:
                        break
                    t = t1
                pc += 1
            pcs[u] = pc
            clock[u] = t
            executed += pc - pc0
        self.executed += executed

    def resume(self, u: int, pc: int, t: float) -> None:
        """A blocked unit goes on at slot pc, its clock t (woken: run ahead next)."""
        self.pcs[u], self.clock[u], self.wait[u] = pc, t, RUNNABLE
        self.stack.append(u)

    def op_handlers(self) -> dict:
        """The ops that may block, by op code: (unit, slot, its clock) -> its new clock, or None
        when it blocks there (its `wait` says on what). RECV's: a receive whose blocking sender
        waits for it -> the tensor's arrival. Closures over the engine's state."""
        heap, seq, programs, start, box, clock, wait, stack, unacked, acked, collectives, offers, dp = (
            self.heap, self.seq, self.programs, self.start, self.box, self.clock, self.wait, self.stack,
            self.unacked, self.acked, self.collectives, self.offers, self.dp)
        resume = self.resume

        def meet(u: int, pc: int, t: float) -> float:
            """The transfer starts at the later of their clocks; the sender goes on when it ends."""
            w, wslot, ts, d = offers.pop((u, pc))
            a = box[u][pc] = (ts if ts > t else t) + d
            start[w][wslot] = a - d
            resume(w, wslot + 1, a)
            return a

        def send_sync(u: int, pc: int, t: float) -> float | None:
            """A blocking send: waits for its receive, then both go on when the transfer ends."""
            _, dur, ddst, dslot, _ = programs[u]
            v, j = u + ddst[pc], dslot[pc]
            if wait[v] != j:                    # the receiver is not there yet: leave an offer
                offers[(v, j)] = (u, pc, t, dur[pc])
                wait[u] = RENDEZVOUS
                return None
            t0 = clock[v] if clock[v] > t else t
            start[u][pc] = t0
            box[v][j] = t0 + dur[pc]
            wait[v] = RUNNABLE
            stack.append(v)
            return t0 + dur[pc]

        def allreduce(u: int, pc: int, t: float) -> float | None:
            """A DP collective: starts when every replica of the stage reached it, at the latest clock."""
            s = u // dp
            key = s * (1 << 32) + pc
            c = collectives.get(key)
            if c is None:
                c = collectives[key] = [0, t]
            c[0] += 1
            if t > c[1]:
                c[1] = t
            if c[0] < dp:
                wait[u] = COLLECTIVE
                return None
            del collectives[key]
            t0 = c[1]
            t1 = t0 + programs[u][1][pc]
            for w in range(s * dp, s * dp + dp):
                start[w][pc] = t0
                if w != u:
                    resume(w, pc + 1, t1)
            return t1

        def wait_acks(u: int, pc: int, t: float) -> float | None:
            """Before the optimizer step: every WAN send so far delivered, then its latest ACK
            back, then the step-wide collective (its duration, 0 unless modelled)."""
            if unacked[u]:
                wait[u] = ACKS
                return None
            start[u][pc] = t
            return (acked[u] if acked[u] > t else t) + programs[u][1][pc]

        def pooled_compute(u: int, pc: int, t: float) -> None:
            """A compute that needs a core: the pool says when it ends (CORE_START, CORE_DONE)."""
            start[u][pc] = t
            wait[u] = CORE
            heappush(heap, (t, 0, next(seq), CORE_START, u, pc))
            return None

        return {RECV: meet, SEND_SYNC: send_sync, ALLREDUCE: allreduce, WAIT_ACKS: wait_acks,
                COMPUTE_POOLED: pooled_compute}

    # -- heap events --------------------------------------------------------------------------
    def event_handlers(self) -> tuple:
        """One handler per kind of heap event, indexed by kind: (now, x, y) -> None. Closures over
        the engine's state, which they read and change (the engine calls one per event)."""
        heap, seq, links, sends, ack_s, units, dp = (self.heap, self.seq, self.links, self.sends, self.ack_s,
                                                     self.units, self.dp)
        programs, box, start, wait, stack, unacked, acked = (self.programs, self.box, self.start, self.wait,
                                                             self.stack, self.unacked, self.acked)

        def arrive(now: float, u: int, slot: int) -> None:
            """A WAN send enters its link; its flow: (sending unit, receiving unit)."""
            wan_of, nbytes, ddst = sends[u // dp]
            li = wan_of[slot]
            link = links[li]
            n = next(seq)
            if type(link) is FairLink:
                nxt = link.arrive(now, nbytes[slot], n, u, slot, u * units + u + ddst[slot])
                if nxt is not None:
                    heappush(heap, (nxt, 0, n, FAIR_DONE, li, link.version))
            else:
                nxt = link.arrive(now, nbytes[slot], n, u, slot, u % dp, u * units + u + ddst[slot])
                if nxt is not None:
                    heappush(heap, (nxt, 1, n, DISPATCH, li, 0))

        def fair_done(now: float, li: int, version: int) -> None:
            """Transfers whose last byte left now: delivered one latency later (waking a receiver
            that waits for it), their ACK back at the sender `ack_s` after now (waking a WAIT_ACKS)."""
            link = links[li]
            if link.version != version:
                return                            # superseded by a later arrival or completion
            when = now + link.latency
            done, started = link.complete(now)
            ack = now + ack_s[li]
            for u, slot in done:
                _, _, ddst, dslot, _ = programs[u]
                v, j = u + ddst[slot], dslot[slot]
                box[v][j] = when
                if wait[v] == j:
                    wait[v] = RUNNABLE
                    stack.append(v)
                unacked[u] -= 1
                if ack > acked[u]:
                    acked[u] = ack
                if wait[u] == ACKS and not unacked[u]:
                    wait[u] = RUNNABLE
                    stack.append(u)
            for u, slot in started:
                start[u][slot] = now
            if link.heads:
                heappush(heap, (link.next_completion(), 0, next(seq), FAIR_DONE, li, link.version))

        def dispatch(now: float, li: int, _: int) -> None:
            """A temporal link admits what waits for it (after every arrival of the instant)."""
            link = links[li]
            for u, slot in link.admit(now):
                start[u][slot] = now
            if link.heads:
                heappush(heap, (link.next_completion(), 0, next(seq), FAIR_DONE, li, link.version))

        cores, end, resume = self.cores, self.end, self.resume

        def core_start(now: float, u: int, slot: int) -> None:
            cores.add(now, u, slot, programs[u][1][slot])
            heappush(heap, (cores.next_completion(), 0, next(seq), CORE_DONE, cores.version, 0))

        def core_done(now: float, version: int, _: int) -> None:
            """The pool's computes whose work is done: their units go on."""
            if version != cores.version:
                return                            # superseded: another compute started or ended since
            done = cores.pop_done(now)
            for u, slot in done:
                end[u][slot] = now
                resume(u, slot + 1, now)
            self.executed += len(done)
            nxt = cores.next_completion()
            if nxt is not None:
                heappush(heap, (nxt, 0, next(seq), CORE_DONE, cores.version, 0))

        return arrive, fair_done, dispatch, core_start, core_done

    # -----------------------------------------------------------------------------------------
    def check_finished(self) -> None:
        stuck = [u for u in range(self.units) if self.pcs[u] < len(self.prog.stages[u // self.dp])]
        if stuck:
            u = stuck[0]
            s, d = divmod(u, self.dp)
            p = self.prog.stages[s]
            pc = self.pcs[u]
            what = "a collective" if self.wait[u] == COLLECTIVE else \
                f"slot {pc} (virtual stage {p.vstage[pc]}, micro-batch {p.mb[pc]})"
            raise GeotrainError(f"the schedule deadlocks: {len(stuck)} GPUs never finish; stage {s} replica {d} "
                                f"waits at {what}")


def _bar(total: int):
    # lazy: tqdm only when called (importers that never call it stay free of it)
    from tqdm import tqdm

    return tqdm(total=total, desc="simulate", unit="act", unit_scale=True, leave=False)
