"""What a WAN message and the per-step global all-reduce really cost, read off a measured trace.

The source is the profile's calibration run (a 2-stage 1F1B pipeline, one stage per DC):
* `waiting_overhead`: per boundary tensor, its arrival (the receiver's recv_wait end) minus when
  it was due (its producer's end + serialization behind earlier messages on its connections +
  latency), over messages whose receiver was already waiting -- only there is the arrival
  observed. The median is the transport's own cost per message (its threads' hand-offs, each
  needing a core). Why not a fitted constant: docs/DECISIONS.md, Calibration.
* `global_sync`: the runtime's all-reduce of (overflow flag, loss) over all ranks before every
  optimizer step: per iteration, the minimum over ranks of that wait (recv_wait with stage -1).
"""

from __future__ import annotations

import statistics


def message_overheads(trace, plan, latency_s: float, seconds_per_byte: float,
                      warmup: int) -> list[tuple[float, bool]]:
    """(overhead_s, receiver_was_waiting) per cross-stage boundary tensor of a 2-stage `plan`
    (activations stage 0 -> 1, gradients 1 -> 0, within each DP replica)."""
    first = min(e.iteration for e in trace.events) + warmup
    stage_of = {plan.rank(s, d): s for s in range(plan.pp) for d in range(plan.dp)}
    replica_of = {plan.rank(s, d): d for s in range(plan.pp) for d in range(plan.dp)}
    sent = {}
    for e in trace.events:
        if e.iteration < first or e.rank not in stage_of:
            continue
        if e.kind == "forward" and stage_of[e.rank] == 0:
            sent[("act", replica_of[e.rank], e.iteration, e.mb)] = e.end
        elif e.kind in ("backward", "backward_input") and stage_of[e.rank] == 1:
            sent[("grad", replica_of[e.rank], e.iteration, e.mb)] = e.end
    recvs = {}
    for e in trace.events:
        if e.iteration < first or e.kind != "recv_wait" or e.stage < 0 or e.rank not in stage_of:
            continue
        key = ("act" if stage_of[e.rank] == 1 else "grad", replica_of[e.rank], e.iteration, e.mb)
        if key in sent:
            recvs[key] = e
    # Messages of one direction and replica share their connections: each leaves when the one
    # before it has been serialized (FIFO, as the simulator's links also queue them).
    out = []
    for kind in ("act", "grad"):
        for d in range(plan.dp):
            keys = sorted((k for k in recvs if k[0] == kind and k[1] == d), key=lambda k: sent[k])
            free = float("-inf")
            for k in keys:
                e = recvs[k]
                free = max(sent[k], free) + (e.bytes or 0) * seconds_per_byte
                due = free + latency_s
                waiting = e.start < due and e.duration > 2e-4
                out.append((e.end - due, waiting))
    return out


def waiting_overhead(trace, plan, latency_s: float, seconds_per_byte: float, warmup: int) -> float | None:
    """Median per-message transport overhead where the receiver waited (None: no such message)."""
    xs = [o for o, waiting in message_overheads(trace, plan, latency_s, seconds_per_byte, warmup) if waiting]
    return max(0.0, statistics.median(xs)) if xs else None


def global_sync(trace, warmup: int) -> float | None:
    """Median over iterations of the shortest wait at the world-wide loss/overflow all-reduce."""
    first = min(e.iteration for e in trace.events) + warmup
    per_it: dict[int, float] = {}
    for e in trace.events:
        if e.iteration >= first and e.kind == "recv_wait" and e.stage == -1:
            per_it[e.iteration] = min(per_it.get(e.iteration, float("inf")), e.duration)
    return statistics.median(per_it.values()) if per_it else None
