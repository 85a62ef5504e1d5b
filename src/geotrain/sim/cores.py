"""A host's CPU cores as a resource the simulated ranks share: for CPU-emulated runs with more ranks
than cores.

On a GPU cluster every rank has its own GPU, and a CPU run with a core per rank has its own core:
the engine then gives each unit its compute time and no pool exists (`run_engine(cores=None)`:
no per-event cost). When the ranks of one host outnumber its cores (the validation set's pp2 x dp2
and pp4 runs: four single-thread ranks on two cores), compute needs a core; a rank that waits on a
message or a collective holds none; a rank woken by a tensor competes for the cores with whoever is
computing at that instant.

Which scheduling model, by measurement. Linux shares the cores by timeslices (EEVDF on the 6.18
kernel here, CFS before it; slices of ~1-3 ms) and a task woken after a sleep keeps its lag, so it
runs within about a slice of waking: on the scale of a 2-10 ms compute action the cores behave as
*processor sharing*, not as FIFO run-to-completion (a woken rank would then wait for a whole
action of another rank to finish). Measured on the 2-core validation machine: the profile's contention table
(k processes timing the same compute unit at once) reads 1.28 / 1.88 / 2.27 at k = 2 / 3 / 4 --
every unit stretched about k / C-fold, where run-to-completion would leave each unit at its
isolated time (1.0) and make the k-th wait instead; and in the 4-rank runs' traces a forward or
backward of 4-8 ms lasts 1.4-1.8x its 2-rank time, stretched while others compute, where FIFO would
show unstretched compute behind a wait. So: every unit computing at an instant progresses at the
same rate 1 / slowdown[k], k = the number computing (`CorePool.slowdown`; the caller derives it from
the profile: processor sharing on C cores with the profile's background and residual,
calibrate.calibrated_costs). A compute action starts when its rank reaches it (as the runtime records it) and
ends when its work is done at the shared rate -- its recorded duration stretches, as measured.

Exact as an event model: a pooled compute's start and each completion go through the engine's
time-ordered heap, so the set of units computing is known at every instant; all jobs progress at
one rate, so the one with the least work left ends first.
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
