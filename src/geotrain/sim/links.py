"""WAN link directions as shared resources, under the two sharing policies.

Both keep only what the policy needs and return times; the engine owns the event heap.

FairLink -- processor sharing among flows (what concurrent TCP flows converge to). A flow is a
(sending GPU, receiving GPU) pair: its transfers share the same connections, so they go one
after the other (FIFO), while the k flows with something to send each progress at
min(flow_rate, capacity / k). Every flow on one direction has the same cap (one LinkPlan per
DC pair), so all active flows progress at the same rate and the "virtual service" trick
applies: `served` is the bytes every active flow has received so far; a transfer that starts
with b bytes finishes when `served` reaches its start level + b. A heap of finish levels gives
the next completion in O(log k); a change of k only changes the rate. The last byte reaches
the receiver one latency after it left. With one flow on the direction this is exactly the
temporal policy (one transfer at a time at the flow rate).

TemporalLink -- transfers take turns, each at its full flow rate; the waiting transfer with the
earliest ready time goes next, ties broken by the plan's pipeline order. The link is busy only
for the serialization time (bytes / rate): the next transfer starts while the previous one's
bytes are still propagating, so latency overlaps.
"""

from __future__ import annotations

from collections import deque
from heapq import heappop, heappush


class FairLink:
    __slots__ = ("capacity", "flow_rate", "latency", "served", "t", "heads", "queues", "version")

    def __init__(self, capacity: float, flow_rate: float, latency: float):
        self.capacity, self.flow_rate, self.latency = capacity, flow_rate, latency
        self.served = 0.0     # bytes each active flow received since the link was last idle
        self.t = 0.0          # time `served` refers to
        # per active flow, its transfer being sent: (finish level, seq, flow, unit, slot)
        self.heads: list[tuple[float, int, int, int, int]] = []
        self.queues: dict[int, deque] = {}  # active flow -> transfers waiting behind its head
        self.version = 0      # bumps whenever the predicted next completion changes

    def _rate(self) -> float:
        share = self.capacity / len(self.heads)
        return self.flow_rate if self.flow_rate < share else share

    def _advance(self, now: float) -> None:
        if self.heads:
            self.served += self._rate() * (now - self.t)
        else:
            self.served = 0.0
        self.t = now

    def arrive(self, now: float, nbytes: int, seq: int, unit: int, slot: int, flow: int) -> float | None:
        """A transfer enters. Returns the new time of the next completion (the caller schedules
        it under the new `version`), or None when the transfer only queued behind its flow's
        current one (nothing changes until that one finishes)."""
        q = self.queues.get(flow)
        if q is not None:
            q.append((nbytes, seq, unit, slot))
            return None
        self._advance(now)
        self.queues[flow] = deque()
        heappush(self.heads, (self.served + nbytes, seq, flow, unit, slot))
        self.version += 1
        return self.next_completion()

    def next_completion(self) -> float:
        level = self.heads[0][0]
        return self.t + max(0.0, level - self.served) / self._rate()

    def complete(self, now: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The predicted completion happened. Returns (finished, started): (unit, slot) of the
        transfers whose last byte left now (the caller delivers them at now + latency), and of
        the queued ones that now start being sent. The caller reschedules if heads remain."""
        self._advance(now)
        level = self.heads[0][0]
        self.served = max(self.served, level)   # snap to the exact level: no drift
        tol = 1e-9 * (abs(level) + 1.0)
        done, started = [], []
        while self.heads and self.heads[0][0] <= self.served + tol:
            _, _, flow, u, s = heappop(self.heads)
            done.append((u, s))
            q = self.queues[flow]
            if q:
                nbytes, seq, nu, ns = q.popleft()
                heappush(self.heads, (self.served + nbytes, seq, flow, nu, ns))
                started.append((nu, ns))
            else:
                del self.queues[flow]
        self.version += 1
        return done, started


class TemporalLink:
    __slots__ = ("flow_rate", "latency", "priority", "free_at", "waiting", "pending")

    def __init__(self, flow_rate: float, latency: float, priority: tuple[int, ...]):
        self.flow_rate, self.latency, self.priority = flow_rate, latency, priority
        self.free_at = 0.0
        self.waiting: list[tuple[float, int, int, int, int, int]] = []  # (ready, prio, seq, nbytes, unit, slot)
        self.pending = False   # a dispatch is scheduled

    def arrive(self, now: float, nbytes: int, seq: int, unit: int, slot: int, replica: int) -> float | None:
        """A transfer is ready; returns the time of a dispatch to schedule, or None if one is
        already scheduled."""
        heappush(self.waiting, (now, self.priority[replica], seq, nbytes, unit, slot))
        if self.pending:
            return None
        self.pending = True
        return now if now > self.free_at else self.free_at

    def dispatch(self, now: float) -> tuple[int, int, float, float | None]:
        """Start the next transfer: returns (unit, slot, arrival time at the receiver, time of
        the next dispatch to schedule or None)."""
        _, _, _, nbytes, unit, slot = heappop(self.waiting)
        self.free_at = now + nbytes / self.flow_rate
        arrival = self.free_at + self.latency
        if self.waiting:
            return unit, slot, arrival, self.free_at
        self.pending = False
        return unit, slot, arrival, None
