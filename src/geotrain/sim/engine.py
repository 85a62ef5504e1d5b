"""The discrete-event engine: runs every GPU's program against the links.

Why it is fast: a GPU's timeline depends only on its own compute times, on when its inputs
arrive and on its DP collectives -- not on a global clock. So each GPU ("unit": one stage
replica; its tp group moves as one) runs ahead as far as it can in a tight loop over integer op
codes, and stops only at a receive whose tensor has not arrived yet, or at an all-reduce its
replicas have not all reached. Intra-DC sends have a known arrival time (latency + bytes /
bandwidth; intra-DC contention is not modelled), so they are delivered at once, waking the
receiver if it waits. Only WAN transfers, whose finish depends on what else shares the link,
go through a global event heap, processed in time order (links.py: fair sharing between flows
-- a flow is a (sending GPU, receiving GPU) pair, FIFO inside -- or temporal turns).

That is exact, not an approximation: every event pushed on the heap is at or after the heap's
current time, because a unit only runs when woken by something that happened at or before its
own clock (start, an arrival, a collective's end), and its clock never goes back. Ties at one
instant: link arrivals and link completions first (phase 0), then temporal admissions (phase 1),
so a temporal link picks among *all* transfers ready at that instant by plan order.

Before its optimizer step a GPU waits until every WAN send it made is acknowledged, as the
runtime does (its transport completes a send on the receiver's ACK): a WAIT_ACKS slot blocks
while any of its transfers is undelivered, then until the latest ACK is back (delivery plus the
direction's `ack_s`, one round trip by default).

Blocking sends (SEND_SYNC, `p2p="blocking"`: DeepSpeed's pipe engine): a send and its receive meet.
The first to arrive waits -- a receive as always (its slot), a send by leaving an offer keyed by
the receive's (unit, slot); the second starts the transfer at the later of the two clocks and both
go on when it ends (dur later).

CPU cores (`cores`, a sim.cores.CorePool; CPU-emulated runs whose ranks outnumber the host's
cores only): each compute action then needs a core -- it is posted on the heap at the time its
unit reaches it (phase 0, code _CORE_START) and ends when the pool says its work is done at the
shared rate (_CORE_DONE, versioned like a fair link's completion); the unit waits meanwhile
(wait -4). The compute op codes are remapped to _POOLED in a copy of the programs, so a run
without a pool executes exactly the loop it always did.

What it records: for each unit and program slot, one float -- when the action started (a
receive: when the GPU reached it; a WAN send: when the transfer entered the link) -- and for
each receive slot, when its tensor arrived. Everything in the trace follows from these two
arrays plus the compiled program, so no event object is built during the run. With a core pool
also when each compute ended (`end`; without one, start + duration).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from heapq import heappop, heappush

from geotrain.errors import GeotrainError
from geotrain.sim.cores import CorePool
from geotrain.sim.links import FairLink, TemporalLink
from geotrain.sim.program import (
    ALLREDUCE,
    COMPUTE,
    RECV,
    SEND_INTRA,
    SEND_LOCAL,
    SEND_SYNC,
    SEND_WAN,
    WAIT_ACKS,
    Program,
)
from geotrain.transport.turns import concurrent_turns

_ARRIVE, _FAIR_DONE, _DISPATCH, _CORE_START, _CORE_DONE = 0, 1, 2, 3, 4
_POOLED = 7                  # a COMPUTE slot that needs a core from the pool (see module docstring)


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
    """Run the program (see the module docstring). `unit_dur`: per unit (stage * dp + replica), per
    slot, its own durations instead of its stage's -- a replay of measured compute, where every
    rank's every action took its own time (calibrate.replay); `end` then holds each slot's end."""
    t_wall = time.perf_counter()
    dp = prog.dp
    P = len(prog.stages)
    U = P * dp
    assert ALLREDUCE == 5 and COMPUTE == 0 and RECV == 1 and SEND_LOCAL == 2 and SEND_INTRA == 3 and SEND_WAN == 4
    assert WAIT_ACKS == 6 and SEND_SYNC == 8
    stage_data = []
    for s, p in enumerate(prog.stages):
        ddst = [(ds - s) * dp if ds >= 0 else 0 for ds in p.dst_stage]
        ops = p.ops if cores is None else [_POOLED if op == COMPUTE else op for op in p.ops]
        stage_data.append((ops, p.dur, ddst, p.dst_slot, len(p)))
    if unit_dur is not None and (len(unit_dur) != U or any(len(d) != len(prog.stages[u // dp])
                                                               for u, d in enumerate(unit_dur))):
        raise ValueError("unit_dur needs one duration per slot of every unit's program")
    # per unit: its stage's program (replicas share the lists) with its own durations under a replay
    sdata = [stage_data[u // dp] if unit_dur is None else stage_data[u // dp][:1] + (unit_dur[u],)
             + stage_data[u // dp][2:] for u in range(U)]
    lengths = [len(p) for p in prog.stages]
    start = [[0.0] * lengths[u // dp] for u in range(U)]
    box = [[-1.0] * lengths[u // dp] for u in range(U)]
    end = [[-1.0] * lengths[u // dp] for u in range(U)] if cores is not None else None
    pcs = [0] * U
    clock = [float(offsets[u % dp]) if offsets else 0.0 for u in range(U)]
    # slot a unit is blocked on (-1 running/runnable, -2 in a collective, -3 acks, -4 a core, -5 a blocking send)
    wait = [-1] * U
    # WAN sends not yet delivered, and when the latest delivered one's ACK reaches its sender.
    unacked = [0] * U
    acked = [0.0] * U
    ack_of = [w.ack_s for w in prog.wan]
    links: list[FairLink | TemporalLink] = [
        FairLink(w.capacity, w.flow_rate, w.latency) if w.sharing == "fair"
        else TemporalLink(w.flow_rate, w.latency, w.priority, w.capacity, concurrent_turns(w.capacity, w.flow_rate),
                          w.turn_s)
        for w in prog.wan
    ]
    wan_of = [p.wan for p in prog.stages]
    nbytes_of = [p.nbytes for p in prog.stages]
    ddst_of = [d[2] for d in stage_data]
    collectives: dict[int, list] = {}
    offers: dict[tuple[int, int], tuple[int, int, float, float]] = {}   # blocking sends waiting for their receive
    heap: list[tuple] = []
    seq = 0
    heap_events = 0
    stack = list(range(U - 1, -1, -1))
    total = sum(lengths[u // dp] for u in range(U))
    bar = None
    if progress:
        # lazy: tqdm only when called (importers that never call it stay free of it)
        from tqdm import tqdm

        bar = tqdm(total=total, desc="simulate", unit="act", unit_scale=True, leave=False)
    executed = 0
    shown = 0

    def deliver(u: int, slot: int, when: float) -> None:
        _, _, ddst, dslot, _ = sdata[u]
        v = u + ddst[slot]
        j = dslot[slot]
        box[v][j] = when
        if wait[v] == j:
            wait[v] = -1
            stack.append(v)

    while True:
        while stack:
            u = stack.pop()
            ops, dur, ddst, dslot, L = sdata[u]
            pc = pc0 = pcs[u]
            t = clock[u]
            mst = start[u]
            mbox = box[u]
            while pc < L:
                op = ops[pc]
                if op == 0:                      # COMPUTE
                    mst[pc] = t
                    t += dur[pc]
                elif op == 1:                    # RECV
                    a = mbox[pc]
                    if a < 0.0:
                        offer = offers.pop((u, pc), None) if offers else None
                        if offer is None:
                            wait[u] = pc
                            break
                        w, wslot, ts, d = offer      # a blocking sender waits here: meet, transfer
                        a = mbox[pc] = (ts if ts > t else t) + d
                        start[w][wslot] = a - d
                        pcs[w] = wslot + 1
                        clock[w] = a
                        wait[w] = -1
                        stack.append(w)
                    mst[pc] = t
                    if a > t:
                        t = a
                elif op == 3:                    # SEND_INTRA
                    mst[pc] = t
                    v = u + ddst[pc]
                    j = dslot[pc]
                    box[v][j] = t + dur[pc]
                    if wait[v] == j:
                        wait[v] = -1
                        stack.append(v)
                elif op == 4:                    # SEND_WAN: enters its link in time order
                    mst[pc] = t
                    unacked[u] += 1
                    seq += 1
                    heappush(heap, (t, 0, seq, _ARRIVE, u, pc))
                elif op == 5:                    # ALLREDUCE
                    s = u // dp
                    key = s * (1 << 32) + pc
                    c = collectives.get(key)
                    if c is None:
                        c = collectives[key] = [0, t]
                    c[0] += 1
                    if t > c[1]:
                        c[1] = t
                    if c[0] < dp:
                        wait[u] = -2
                        break
                    del collectives[key]
                    t0 = c[1]
                    t = t0 + dur[pc]
                    for w in range(s * dp, s * dp + dp):
                        start[w][pc] = t0
                        if w != u:
                            pcs[w] = pc + 1
                            clock[w] = t
                            wait[w] = -1
                            stack.append(w)
                elif op == 6:                    # WAIT_ACKS: every WAN send so far acknowledged
                    if unacked[u]:
                        wait[u] = -3
                        break
                    mst[pc] = t
                    if acked[u] > t:
                        t = acked[u]
                    t += dur[pc]                 # then the step-wide collective (0 unless modelled)
                elif op == 8:                    # SEND_SYNC: a rendezvous with the receive
                    v = u + ddst[pc]
                    j = dslot[pc]
                    if wait[v] != j:                 # the receiver is not there yet: wait for it
                        offers[(v, j)] = (u, pc, t, dur[pc])
                        wait[u] = -5
                        break
                    t0 = clock[v] if clock[v] > t else t
                    mst[pc] = t0
                    t = t0 + dur[pc]
                    box[v][j] = t
                    wait[v] = -1
                    stack.append(v)
                elif op == _POOLED:              # COMPUTE on a shared core: the pool says when it ends
                    mst[pc] = t
                    wait[u] = -4
                    seq += 1
                    heappush(heap, (t, 0, seq, _CORE_START, u, pc))
                    break
                else:                            # SEND_LOCAL
                    mst[pc] = t
                    mbox[dslot[pc]] = t
                pc += 1
            pcs[u] = pc
            clock[u] = t
            executed += pc - pc0
            if bar is not None and executed - shown > 65536:
                bar.update(executed - shown)
                shown = executed
        if not heap:
            break
        now, _, _, code, x, y = heappop(heap)
        heap_events += 1
        if code == _ARRIVE:
            s = x // dp
            li = wan_of[s][y]
            link = links[li]
            seq += 1
            if type(link) is FairLink:
                nxt = link.arrive(now, nbytes_of[s][y], seq, x, y, x * U + x + ddst_of[s][y])
                if nxt is not None:
                    heappush(heap, (nxt, 0, seq, _FAIR_DONE, li, link.version))
            else:
                nxt = link.arrive(now, nbytes_of[s][y], seq, x, y, x % dp, x * U + x + ddst_of[s][y])
                if nxt is not None:
                    heappush(heap, (nxt, 1, seq, _DISPATCH, li, 0))
        elif code == _FAIR_DONE:
            link = links[x]
            if link.version != y:
                continue                         # superseded by a later arrival or completion
            when = now + link.latency
            done, started = link.complete(now)
            ack = now + ack_of[x]
            for u, slot in done:
                deliver(u, slot, when)
                unacked[u] -= 1
                if ack > acked[u]:
                    acked[u] = ack
                if wait[u] == -3 and not unacked[u]:
                    wait[u] = -1
                    stack.append(u)
            for u, slot in started:
                start[u][slot] = now
            if link.heads:
                seq += 1
                heappush(heap, (link.next_completion(), 0, seq, _FAIR_DONE, x, link.version))
        elif code == _CORE_START:
            cores.add(now, x, y, sdata[x][1][y])
            seq += 1
            heappush(heap, (cores.next_completion(), 0, seq, _CORE_DONE, cores.version, 0))
        elif code == _CORE_DONE:
            if x != cores.version:
                continue                         # superseded: another compute started or ended since
            for u, slot in cores.pop_done(now):
                end[u][slot] = now
                executed += 1
                pcs[u] = slot + 1
                clock[u] = now
                wait[u] = -1
                stack.append(u)
            nxt = cores.next_completion()
            if nxt is not None:
                seq += 1
                heappush(heap, (nxt, 0, seq, _CORE_DONE, cores.version, 0))
        else:                                    # _DISPATCH: a temporal link admits waiting transfers
            link = links[x]
            for u, slot in link.admit(now):
                start[u][slot] = now
            if link.heads:
                seq += 1
                heappush(heap, (link.next_completion(), 0, seq, _FAIR_DONE, x, link.version))
    if bar is not None:
        bar.update(total - shown)
        bar.close()
    stuck = [u for u in range(U) if pcs[u] < lengths[u // dp]]
    if stuck:
        u = stuck[0]
        s, d = divmod(u, dp)
        p = prog.stages[s]
        pc = pcs[u]
        what = "a collective" if wait[u] == -2 else f"slot {pc} (virtual stage {p.vstage[pc]}, micro-batch {p.mb[pc]})"
        raise GeotrainError(f"the schedule deadlocks: {len(stuck)} GPUs never finish; stage {s} replica {d} "
                            f"waits at {what}")
    if unit_dur is not None and end is None:
        end = [[st + d for st, d in zip(start[u], unit_dur[u])] for u in range(U)]
    return EngineResult(start=start, arrival=box, actions=executed, wan_events=heap_events,
                        wall_s=time.perf_counter() - t_wall, end=end)
