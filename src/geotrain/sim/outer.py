"""Simulate a DiLoCo plan: the workers' inner steps (each worker's layout simulated as an ordinary
plan; the slowest worker sets the pace, since every exchange waits for all of them) and the outer
exchanges between them, priced by layout.outer_cost.

Per inner step: the inner iteration plus, amortized, the part of each exchange its overlap does
not hide and the outer optimizer step (F exchanges per H steps). The timeline (`trace`) shows
worker 0's ranks over enough inner steps to hold its first exchange: each exchange as an
`outer_sync` event on its WAN link directions (beside the compute when it overlaps), the training
waiting for it as `outer_wait`, the outer step as `outer_step`; later events shift by what waits.
"""

from __future__ import annotations

from dataclasses import replace

from geotrain.layout.outer_cost import OuterCost, outer_cost
from geotrain.layout.plan import Plan
from geotrain.layout.stage_costs import StageCosts
from geotrain.trace.metrics import Metrics
from geotrain.trace.schema import Event, Trace

MAX_TIMELINE_STEPS = 64
TIMELINE_EVENTS = 500_000     # the timeline shows a whole period when it holds fewer events than this


class OuterSimResult:
    """A DiLoCo plan's simulation: `inner` (the slowest worker's SimResult), `outer` (OuterCost),
    per inner step `iteration_time` and `metrics` (tokens of every worker, WAN bytes with the
    outer exchange's share), `trace` the timeline (see the module docstring), simulated when first
    read -- the planner prices modes without it."""

    def __init__(self, plan: Plan, inner, outer: OuterCost, timeline, tokens: int):
        self.plan, self.inner, self.outer = plan, inner, outer
        self.schedule = inner.schedule
        self.iteration_time = inner.iteration_time + outer.per_step_s
        self._tokens = tokens
        self._metrics: Metrics | None = None
        self._timeline, self._trace = timeline, None

    @property
    def trace(self) -> Trace:
        if self._trace is None:
            self._trace = self._timeline()
        return self._trace

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / self.iteration_time

    @property
    def metrics(self) -> Metrics:
        if self._metrics is None:
            m = self.inner.metrics
            t = self.iteration_time
            self._metrics = replace(m, iteration_time=t, tokens_per_s=self.tokens_per_s,
                                    mean_utilization=m.mean_utilization * m.iteration_time / t,
                                    wan_bytes=int(m.wan_bytes * self.plan.num_workers + self.outer.wan_bytes_per_step))
        return self._metrics


def simulate_outer(spec, plan: Plan, iterations: int, simulate_one, costs: StageCosts | None = None,
                   cost=None) -> OuterSimResult:
    """`simulate_one(spec, plan, iterations)`: the simulator of an ordinary plan (sim.simulate)."""
    o = plan.outer
    kinds: dict[tuple, Plan] = {}
    for w in range(o.num_workers):       # workers alike in GPU types simulate once
        wp = plan.worker_plan(w).inner_plan()
        kinds.setdefault(tuple(spec.cluster.dc(st.dc).gpu_type for st in wp.stages), wp)
    results = [simulate_one(spec, wp, 1) for wp in kinds.values()]
    slowest = max(results, key=lambda r: r.iteration_time)
    costs = costs or StageCosts.for_plan(spec, plan, cost)
    out = outer_cost(costs, plan, slowest.iteration_time)
    first = next(iter(kinds.values()))
    # A whole period where the plan is small; else up to the first exchange's outer step.
    events = len(slowest.trace.events) if first.num_ranks <= 64 else TIMELINE_EVENTS
    period = o.inner_steps + o.overlap
    steps = period if events * period <= TIMELINE_EVENTS else o.fragment_offset(0) + o.overlap
    steps = min(MAX_TIMELINE_STEPS, max(iterations, steps))

    def timeline() -> Trace:
        return _timeline(simulate_one(spec, first, steps).trace, plan, out, steps)

    return OuterSimResult(plan, slowest, out, timeline, plan.global_batch * spec.model.seq_len)


def _timeline(inner: Trace, plan: Plan, out: OuterCost, steps: int) -> Trace:
    """Worker 0's inner trace with its exchanges, waits and outer steps inserted (see module
    docstring): every event of a later inner step moves by what the training waited before it."""
    o = plan.outer
    ends: dict[int, float] = {}
    for e in inner.events:
        ends[e.iteration] = max(ends.get(e.iteration, 0.0), e.end)
    ranks = sorted({e.rank for e in inner.events})
    delays: list[tuple[int, float]] = []         # (inner step index applied after, seconds it adds)
    added: list[Event] = []

    def delay(it: int) -> float:                 # what events of step index `it` are moved by
        return sum(d for at, d in delays if at < it)

    for it in range(steps):
        for f in o.syncs_after(it + 1):
            if it + o.overlap >= steps:
                continue
            t0 = ends.get(it, 0.0) + delay(it + 1)
            for a, b in sorted(out.exchange_bytes):
                added.append(Event(rank=ranks[0], kind="outer_sync", start=t0, end=t0 + out.exchange_s, stage=f,
                                   bytes=int(out.exchange_bytes[(a, b)]), link=f"{a}->{b}", iteration=it))
            at_it = it + o.overlap
            at = ends.get(at_it, t0) + delay(at_it + 1)
            wait = out.exposed_s if o.overlap else out.exchange_s
            for r in ranks:
                if wait > 0:
                    added.append(Event(rank=r, kind="outer_wait", start=at, end=at + wait, stage=f, iteration=at_it))
                added.append(Event(rank=r, kind="outer_step", start=at + wait, end=at + wait + out.optimizer_s,
                                   stage=f, iteration=at_it))
            delays.append((at_it, wait + out.optimizer_s))
    moved = [replace(e, start=e.start + delay(e.iteration), end=e.end + delay(e.iteration)) for e in inner.events]
    meta = {**inner.meta, "outer": {"exchange_s": out.exchange_s, "exposed_s": out.exposed_s,
                                    "per_step_s": out.per_step_s, "workers": o.num_workers,
                                    "inner_steps": o.inner_steps, "fragments": o.fragments}}
    return Trace(events=moved + added, num_ranks=inner.num_ranks, source="sim", meta=meta)
