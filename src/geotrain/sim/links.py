"""WAN link directions as shared resources, under the two sharing policies.

`FairLink` is processor sharing among flows, what concurrent TCP flows converge to; `TemporalLink`
lets transfers take work-conserving turns, at most `slots` at once, each paying its turn's
overhead. Both keep only what their policy needs and return times; the engine owns the event
heap. The last byte of a transfer reaches the receiver one latency after it left.
"""

from __future__ import annotations

from collections import deque
from heapq import heappop, heappush


class _SharedLink:
    """Virtual-service accounting both link kinds share: every admitted transfer (a head) gets
    min(per-flow rate, capacity / heads), computed inline (the engine asks per event); `served`
    is the bytes each head received since the link was last idle, so a head finishes when
    `served` reaches its finish level."""

    __slots__ = ("capacity", "flow_rate", "latency", "served", "t", "heads", "version")

    def _advance(self, now: float) -> None:
        if self.heads:
            share = self.capacity / len(self.heads)
            self.served += (self.flow_rate if self.flow_rate < share else share) * (now - self.t)
        else:
            self.served = 0.0
        self.t = now

    def next_completion(self) -> float:
        """When the head with the least left finishes, at the current sharing."""
        share = self.capacity / len(self.heads)
        return self.t + max(0.0, self.heads[0][0] - self.served) / (self.flow_rate if self.flow_rate < share else share)


class FairLink(_SharedLink):
    """Processor sharing among flows. A flow is a (sending GPU, receiving GPU) pair: its transfers
    share connections, so they go one after the other, while the k flows with something to send
    each progress at min(flow_rate, capacity / k). All flows on a direction have one cap, so the
    "virtual service" trick applies: `served` is the bytes every active flow has received; a
    transfer starting with b bytes ends when `served` reaches its start level + b. A heap of finish
    levels gives the next completion in O(log k). With one flow this is the temporal policy."""

    __slots__ = ("queues",)

    def __init__(self, capacity: float, flow_rate: float, latency: float):
        self.capacity, self.flow_rate, self.latency = capacity, flow_rate, latency
        self.served = 0.0     # bytes each active flow received since the link was last idle
        self.t = 0.0          # time `served` refers to
        # per active flow, its transfer being sent: (finish level, seq, flow, unit, slot)
        self.heads: list[tuple[float, int, int, int, int]] = []
        self.queues: dict[int, deque] = {}  # active flow -> transfers waiting behind its head
        self.version = 0      # bumps whenever the predicted next completion changes

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


class TemporalLink(_SharedLink):
    """Work-conserving turns: at most `slots` transfers (`transport.turns.concurrent_turns`: 1 when
    one transfer's connections fill the link) are on it at once, the others wait, the one ready
    first going next (ties: the plan's pipeline order); a ready transfer never waits while a slot
    is free. Each arrives `turn_s` later (`TURN_OVERHEAD_S`: it asks the arbiter first); the link
    loses nothing to it, since a holder hands its turn on that much early. Where transfers are that
    short temporal costs more than it saves, and the planner, which simulates both, keeps fair.
    Same virtual-service accounting as FairLink, over the admitted transfers only."""

    __slots__ = ("priority", "slots", "waiting", "busy", "pending")

    def __init__(self, flow_rate: float, latency: float, priority: tuple[int, ...], capacity: float | None = None,
                 slots: int = 1, turn_s: float = 0.0):
        self.flow_rate, self.priority = flow_rate, priority
        self.latency = latency + turn_s       # a turn's grant delays its transfer, not the link
        self.capacity = flow_rate if capacity is None else capacity
        self.slots = max(1, slots)
        self.served = 0.0
        self.t = 0.0
        self.heads: list[tuple[float, int, int, int, int]] = []   # admitted: (finish level, seq, flow, unit, slot)
        self.waiting: list[tuple] = []  # eligible: (ready, prio, seq, nbytes, unit, slot, flow)
        self.busy: dict[int, deque] = {}  # flow with an admitted transfer -> its transfers queued behind it
        self.pending = False   # an admission is scheduled
        self.version = 0

    def arrive(self, now: float, nbytes: int, seq: int, unit: int, slot: int, replica: int,
               flow: int = -1) -> float | None:
        """A transfer is ready. Returns `now` when an admission is to be scheduled (at this instant,
        after every other arrival of the instant, so ties go by plan order), else None: the link
        is full, or the transfer's flow is sending, and it waits."""
        entry = (now, self.priority[replica], seq, nbytes, unit, slot, flow)
        q = self.busy.get(flow)
        if q is not None:
            q.append(entry)
            return None
        heappush(self.waiting, entry)
        if self.pending or len(self.heads) >= self.slots:
            return None
        self.pending = True
        return now

    def admit(self, now: float) -> list[tuple[int, int]]:
        """Move waiting transfers onto free slots; returns the (unit, slot) of those that start.
        The caller schedules next_completion() under the new `version` if heads remain."""
        self.pending = False
        self._advance(now)
        started = []
        while self.waiting and len(self.heads) < self.slots:
            entry = heappop(self.waiting)
            _, _, seq, nbytes, unit, slot, flow = entry
            q = self.busy.get(flow)
            if q is not None:          # its flow is sending: it goes when that transfer is done
                q.append(entry)
                continue
            self.busy[flow] = deque()
            heappush(self.heads, (self.served + nbytes, seq, flow, unit, slot))
            started.append((unit, slot))
        self.version += 1
        return started

    def complete(self, now: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """As FairLink.complete: the transfers whose last byte left now, and those that start on
        the slots they free."""
        self._advance(now)
        level = self.heads[0][0]
        self.served = max(self.served, level)
        tol = 1e-9 * (abs(level) + 1.0)
        done = []
        while self.heads and self.heads[0][0] <= self.served + tol:
            _, _, flow, u, s = heappop(self.heads)
            done.append((u, s))
            for entry in self.busy.pop(flow):   # eligible again, in their ready order
                heappush(self.waiting, entry)
        return done, self.admit(now)
