"""What the search minimises: iteration time (throughput), or money -- $ per iteration, which is
$ per token since every plan of a job trains the same tokens an iteration ("cost-per-token"), or
$ per hour ("cost") -- under the budget and throughput constraints.

A candidate's price is its estimate's: GPU-hours of the GPUs its layout holds at each DC's
price_per_gpu_hour over the estimated iteration, plus WAN egress of the bytes its plan sends
(layout.price, the one count `plan` prints). A layout's bound is its time bound times its GPUs'
price (egress >= 0), so the scan prunes by money as it prunes by time, and the candidates kept are
the cheapest of a full scan, not the fastest re-ranked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from geotrain.errors import GeotrainError
from geotrain.layout import price
from geotrain.planner.candidate import Candidate
from geotrain.planner.chains import Layout
from geotrain.planner.context import PlanningContext

# The estimate is within ~7 % of the simulator (search.ESTIMATE_BAND): a candidate whose estimate
# misses --min-tokens-per-s by less than that is kept for the simulator to judge.
CONSTRAINT_SLACK = 1.07


@dataclass
class Objective:
    name: str = "throughput"
    max_cost_per_hour: float | None = None
    min_tokens_per_s: float | None = None
    _rates: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.name not in price.OBJECTIVES:
            raise GeotrainError(f"unknown objective {self.name!r} (known: {', '.join(price.OBJECTIVES)})")
        for flag, v in (("--max-cost-per-hour", self.max_cost_per_hour),
                        ("--min-tokens-per-s", self.min_tokens_per_s)):
            if v is not None and not (math.isfinite(v) and v > 0):
                raise GeotrainError(f"{flag} must be a positive number (got {v})")

    @property
    def by_time(self) -> bool:
        """Ranked by time alone (no price needed to rank or to prune)."""
        return self.name == "throughput" and self.max_cost_per_hour is None

    def gpu_rate(self, ctx: PlanningContext, lay: Layout) -> float:
        """$/hour of the GPUs a layout holds (inf where a DC it uses has no price: never cheapest)."""
        key = (ctx.key, lay.chain, lay.counts, lay.dp, lay.span, lay.replicas)
        hit = self._rates.get(key)
        if hit is None:
            if lay.replicas:
                gpus = {dc: n * lay.pp * ctx.tp_of(dc) for dc, n in zip(lay.span, lay.replicas)}
            else:
                gpus = {}
                for dc in lay.stage_dcs:
                    gpus[dc] = gpus.get(dc, 0) + lay.dp * ctx.tp_of(dc)
            rate = price.gpu_cost_per_hour(ctx.cluster, gpus)
            hit = self._rates[key] = math.inf if rate is None else rate
        return hit

    def admits_layout(self, ctx: PlanningContext, lay: Layout, time_bound: float) -> bool:
        """A layout whose GPUs alone exceed the budget never meets it, nor one whose time bound
        misses the throughput asked (with the estimate's slack)."""
        if self.max_cost_per_hour is not None and self.gpu_rate(ctx, lay) > self.max_cost_per_hour:
            return False
        if self.min_tokens_per_s is None:
            return True
        return ctx.job.global_batch * ctx.model.seq_len / time_bound * CONSTRAINT_SLACK >= self.min_tokens_per_s

    def bound(self, ctx: PlanningContext, lay: Layout, time_bound: float) -> float:
        """A lower bound on `key` of every candidate the layout can give."""
        if self.name == "throughput":
            return time_bound
        rate = self.gpu_rate(ctx, lay)
        return rate if self.name == "cost" else rate * time_bound / 3600

    def time_cutoff(self, ctx: PlanningContext, lay: Layout, key_cutoff: float) -> float:
        """The estimate beyond which a candidate of this layout cannot beat `key_cutoff`."""
        if self.name == "throughput":
            return key_cutoff
        if self.name == "cost" or not math.isfinite(key_cutoff):
            return math.inf
        return key_cutoff * 3600 / self.gpu_rate(ctx, lay)

    def key(self, ctx: PlanningContext, cand: Candidate) -> float:
        """The objective's value of a candidate's estimate (inf where it breaks a constraint)."""
        t = cand.est.total
        if self.min_tokens_per_s is not None:
            tokens = ctx.job.global_batch * ctx.model.seq_len
            if tokens / t * CONSTRAINT_SLACK < self.min_tokens_per_s:
                return math.inf
        if self.by_time:
            return t
        rate = self.gpu_rate(ctx, cand.layout)
        if not math.isfinite(rate):
            return math.inf
        egress = price.egress_per_iteration(ctx.spec, cand.to_plan(ctx))
        hour = rate + egress * 3600 / t
        if self.max_cost_per_hour is not None and hour > self.max_cost_per_hour:
            return math.inf
        if self.name == "cost":
            return hour
        return t if self.name == "throughput" else rate * t / 3600 + egress
