"""Fast analytical iteration-time estimate of a pipeline layout (the planner's scoring function).

The search scores thousands of layouts, so this is arithmetic, not simulation; the few best are
then confirmed with the discrete-event simulator. The model, per schedule kind:

* steady-state period per micro-batch = the largest of
  - compute: the slowest stage's forward + backward;
  - WAN bandwidth: per direction of each WAN boundary, the link carries the transfers of all
    `dp` pipelines per micro-batch slot: dp * bytes / rate (temporal sharing: each transfer at the
    full rate in turn; fair sharing: the same total, bounded by the per-transfer cap times dp);
  - WAN latency (Little's law): stage s keeps `inflight_s` micro-batches between its forward and
    its backward, and one round trip through everything downstream (compute + 2 x each boundary's
    delay) must be covered by them: period >= loop_s / inflight_s. WAN-aware 1F1B raises
    inflight_s with extra warm-up forwards exactly to lift this bound;
* fill and drain: one pass of every stage plus each boundary's delay both ways (zero-bubble
  moves weight-gradient work into the bubble; interleaving divides the fill by the chunks);
* tail: each stage's DP all-reduce and optimizer step after its last backward, less the time it
  waits anyway for the stages before it to drain; plus the temporal-sharing start offsets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

WINDOW = 2   # stages after s whose loops with s bound the period (the nearest decide)


@dataclass(frozen=True)
class StageTerms:
    """Per micro-batch, one GPU of a physical stage (all its chunks), plus per-iteration costs."""

    forward: float
    backward: float
    backward_input: float
    backward_weight: float
    allreduce: float = 0.0
    optimizer: float = 0.0

    @property
    def step(self) -> float:
        return self.forward + self.backward


@dataclass(frozen=True)
class BoundaryCosts:
    """One stage boundary (both directions have the same numbers).

    delay: seconds from a send to the last byte's arrival for one transfer (latency + bytes/rate);
    occupancy: seconds per micro-batch slot the link is busy carrying all dp pipelines' transfers."""

    wan: bool
    delay: float
    occupancy: float
    link: str = ""


@dataclass(frozen=True)
class Estimate:
    total: float
    period: float
    compute_period: float
    bandwidth_period: float
    latency_period: float
    fill: float
    tail: float
    offsets: float
    wan_latency: float      # sum of WAN one-way latencies along the chain

    @property
    def limiter(self) -> str:
        """Which term sets the steady-state period."""
        if self.period <= self.compute_period * 1.0001:
            return "compute"
        return "wan-bandwidth" if self.bandwidth_period >= self.latency_period else "wan-latency"


class Held(NamedTuple):
    """What a stage holds at its memory peak: micro-batches whose activations it keeps (whole-stage
    units) and, of them, those a split backward ran B for and not yet W (`CostModel.deferred_bytes`)."""

    inflight: float
    deferred: float = 0.0


def held(kind: str, pp: int, m: int, stage: int, extra: Sequence[int] = (), v: int = 1) -> Held:
    """The memory side of `inflight`: ZB-H1 stage s holds min(m, pp) micro-batches at its peak (a
    deferred W keeps its micro-batch's activations), min(m, s + 1) of them between B and W (it defers
    its first s weight gradients), as its schedule does (`schedule.checks.peak_held`)."""
    if kind == "zb-h1":
        return Held(float(min(m, pp)), float(min(m, stage + 1)))
    return Held(inflight(kind, pp, m, stage, extra, v))


def inflight(kind: str, pp: int, m: int, stage: int, extra: Sequence[int] = (), v: int = 1) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak (in whole-stage units)."""
    e = extra[stage] if stage < len(extra) else 0
    if kind == "gpipe":
        return m
    if kind == "interleaved":
        chunks = min(m * v, (v - 1) * pp + 2 * (pp - 1 - stage) + 1)
        return chunks / v
    return min(m, pp - stage + e)


@dataclass(frozen=True)
class PipelinePart:
    """The part of an estimate that the DP all-reduce and optimizer (so the sharding) leave alone."""

    pipe: float
    period: float
    compute_period: float
    bandwidth_period: float
    latency_period: float
    fill: float


def pipeline_part(stages: Sequence[StageTerms], bounds: Sequence[BoundaryCosts], m: int, kind: str,
                  v: int = 1, extra: Sequence[int] = ()) -> PipelinePart:
    compute = [(s.forward, s.backward, s.backward_input, s.backward_weight) for s in stages]
    steps = [s.step for s in stages]
    t_max = max(steps)
    delays = [b.delay for b in bounds]
    bw = max((b.occupancy for b in bounds), default=0.0)
    lat, k = _latency_period(steps, delays, m, kind, v, extra)
    period = max(t_max, bw, lat)
    fill = _fill(compute, steps, t_max, m, kind, v, bounds)
    comm_fill = 2 * sum(delays) * (v if kind == "interleaved" else 1)
    pipe = _latency_paced(m, max(t_max, bw), lat, k) + fill + comm_fill
    return PipelinePart(pipe, period, t_max, bw, lat, fill + comm_fill)


def _fill(compute: Sequence[tuple[float, float, float, float]], steps: Sequence[float], t_max: float, m: int,
          kind: str, v: int, bounds: Sequence[BoundaryCosts]) -> float:
    """One pass of every stage; zero-bubble moves weight passes into the drain, interleaving
    divides the fill by the chunks."""
    paced, upstream = _link_paced(bounds, t_max, kind, m)
    if kind == "zb-h1":
        # Stage s defers its first min(s, m) weight passes into the drain: with m < pp only m
        # of the pp stages' W can fill it (builders.zb_h1_order).
        # Behind a link that paces the drain, the stages after it have no bubble for W to fill.
        share = min(m, len(compute)) / len(compute)
        return sum(f + bi for f, _, bi, _ in compute) + 2 * max(c[3] for c in compute) \
            - share * sum(c[3] for c in compute[:upstream]) + sum(c[3] for c in compute[upstream:]) + paced
    if kind == "interleaved":
        return t_max + (sum(steps) - t_max) / v
    return sum(steps) + paced


def _link_paced(bounds: Sequence[BoundaryCosts], t_max: float, kind: str, m: int) -> tuple[float, int]:
    """A link slower than the compute paces the stages after it: in 1F1B a stage does its B only
    after its next F arrived (one link period), so each stage after the busiest link but the last
    (which does B right after F) adds a link period, not its step, to the drain -- while there is
    a next F to wait for (m - 1 of them). Returns (that extra, the stages before the link)."""
    if kind == "interleaved" or not bounds:
        return 0.0, len(bounds) + 1
    occ, b = max((x.occupancy, i) for i, x in enumerate(bounds))
    return (min(len(bounds) - 1 - b, m - 1) * (occ - t_max), b + 1) if occ > t_max else (0.0, len(bounds) + 1)


def _latency_paced(m: int, q: float, lat: float, k: int) -> float:
    """(m - 1) periods, where a boundary's round trip (`lat`, over a window whose first stage keeps
    k in flight) sets the period only once the window is full: its first k - 1 micro-batches go
    through at the compute/bandwidth pace `q`."""
    if lat <= q:
        return (m - 1) * q
    return (m - 1) * lat - (k - 1) * (lat - q)


def _latency_period(steps: Sequence[float], delays: Sequence[float], m: int, kind: str, v: int,
                    extra: Sequence[int]) -> tuple[float, int]:
    """Little's law: stage s keeps ks[s] micro-batches between its forward and its backward, and
    the round trip through everything downstream must be covered by them. Returns the period
    and, where a local window sets it, its first stage's in-flight count (else 1)."""
    if kind == "gpipe":
        return 0.0, 1
    pp = len(steps)
    ks = [inflight(kind, pp, m, s, extra, v) if kind != "interleaved" else pp - s for s in range(pp)]
    lat, loop, k_lat = 0.0, 0.0, 1
    for s in range(pp - 1, -1, -1):
        loop += steps[s] + (2 * delays[s] if s < pp - 1 else 0.0)
        k = ks[s]
        if k >= m:
            continue    # every micro-batch in flight at once: none waits for one to come back
        if loop / max(k, 1) > lat:
            lat, k_lat = loop / max(k, 1), 1
        if kind != "interleaved":
            # 1F1B's strict F/B alternation: stages s..t keep only ks[s] - ks[t] + 1 micro-batches
            # between them, so a boundary's round trip is covered locally, not by the whole tail.
            inner = steps[s]
            for t in range(s + 1, min(pp, s + 1 + WINDOW)):
                inner += steps[t] + 2 * delays[t - 1]
                if inner / max(k - ks[t] + 1, 1) > lat:
                    lat, k_lat = inner / max(k - ks[t] + 1, 1), k
    return lat, k_lat


def pipe_floor(compute: Sequence[tuple[float, float, float, float]], bounds: Sequence[BoundaryCosts], m: int,
               kind: str, v: int = 1, extra: Sequence[int] = (), cutoff: float = math.inf) -> float:
    """`pipeline_part(...).pipe` from per-stage (forward, backward, backward_input, backward_weight),
    the same arithmetic (the same value to the bit), for the scorer's cutoff checks -- thousands a
    search, most of them pruning: no StageTerms built, and the latency loop only when the bound
    without it stays under `cutoff` (a value >= cutoff is then a lower bound only)."""
    steps = [f + b for f, b, _, _ in compute]
    t_max = max(steps)
    delays = [b.delay for b in bounds]
    bw = max((b.occupancy for b in bounds), default=0.0)
    comm_fill = 2 * sum(delays) * (v if kind == "interleaved" else 1)
    fill = _fill(compute, steps, t_max, m, kind, v, bounds)
    pipe = (m - 1) * max(t_max, bw) + fill + comm_fill
    if kind == "gpipe" or pipe >= cutoff:
        return pipe
    return _latency_paced(m, max(t_max, bw), *_latency_period(steps, delays, m, kind, v, extra)) + fill + comm_fill


def finish(part: PipelinePart, stages: Sequence[StageTerms], bounds: Sequence[BoundaryCosts],
           offsets: float = 0.0, wan_latency: float = 0.0) -> Estimate:
    """Add the tail: stage s finishes its last backward before stage 0 by the drain through stages < s."""
    tail, slack = 0.0, 0.0
    for s, st in enumerate(stages):
        tail = max(tail, st.allreduce + st.optimizer - slack)
        slack += st.backward + (bounds[s].delay if s < len(bounds) else 0.0)
    total = part.pipe + tail + offsets
    return Estimate(total=total, period=part.period, compute_period=part.compute_period,
                    bandwidth_period=part.bandwidth_period, latency_period=part.latency_period, fill=part.fill,
                    tail=tail, offsets=offsets, wan_latency=wan_latency)


def estimate(stages: Sequence[StageTerms], bounds: Sequence[BoundaryCosts], m: int, kind: str,
             v: int = 1, extra: Sequence[int] = (), offsets: float = 0.0,
             wan_latency: float = 0.0) -> Estimate:
    return finish(pipeline_part(stages, bounds, m, kind, v, extra), stages, bounds, offsets, wan_latency)
