"""A host's CPU cores as a resource the simulated ranks share: for CPU-emulated runs with more ranks
than cores.

Without a pool (GPUs, or a core per rank) the engine gives each unit its compute time, at no
per-event cost. With one, compute needs a core, a rank waiting on a message holds none, and all
units computing at an instant progress at one rate, 1 / slowdown[k] for k computing: processor
sharing, which is how Linux's timeslices behave at the scale of a compute action (measured:
docs/DECISIONS.md, Simulator). A pooled compute's start and end go through the engine's heap, so
the set computing is known at every instant and the one with the least work left ends first.
"""

from __future__ import annotations

from collections.abc import Sequence

_EPS = 1e-12


class CorePool:
    """Processor sharing among the units computing: `slowdown[k]` (k >= 1) is how much slower each
    of k units computing at once runs than alone (>= 1; index 0 unused)."""

    def __init__(self, slowdown: Sequence[float]):
        if len(slowdown) < 2 or any(s <= 0 for s in slowdown[1:]):
            raise ValueError("slowdown needs an entry > 0 for k = 1 .. units")
        self.rate = [0.0] + [1.0 / float(s) for s in slowdown[1:]]
        self.jobs: dict[int, list[float]] = {}    # unit -> [work left (s at rate 1), slot]
        self.t = 0.0
        self.version = 0                          # bumped on every change; stale completions are skipped

    def _advance(self, now: float) -> None:
        k = len(self.jobs)
        if k and now > self.t:
            done = (now - self.t) * self.rate[min(k, len(self.rate) - 1)]
            for j in self.jobs.values():
                j[0] -= done
        if now > self.t:
            self.t = now

    def add(self, now: float, unit: int, slot: int, work: float) -> None:
        """Unit starts computing `work` seconds (its time alone) at `now`."""
        self._advance(now)
        self.jobs[unit] = [float(work), slot]
        self.version += 1

    def next_completion(self) -> float | None:
        """When the job with the least work left ends, at the current sharing; None when idle."""
        if not self.jobs:
            return None
        left = min(j[0] for j in self.jobs.values())
        return self.t + max(0.0, left) / self.rate[min(len(self.jobs), len(self.rate) - 1)]

    def pop_done(self, now: float) -> list[tuple[int, int]]:
        """(unit, slot) of every job finished by `now`."""
        self._advance(now)
        done = [(u, int(j[1])) for u, j in self.jobs.items() if j[0] <= _EPS * max(1.0, abs(now))]
        for u, _ in done:
            del self.jobs[u]
        if done:
            self.version += 1
        return done
