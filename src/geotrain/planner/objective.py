"""What the search minimises: iteration time (throughput), or money -- $ per iteration, which is
$ per token since every plan of a job trains the same tokens an iteration ("cost-per-token"), or
$ per hour ("cost") -- under the budget and throughput constraints.

A cost objective keeps a throughput floor relative to the fastest plan (`min_speed`, by default
half its tokens/s unless --min-tokens-per-s is given): without one the cheapest plan is the
smallest layout that fits (no DP sync, no bubbles), days per step on a cluster of thousands of
GPUs -- the cheapest way to train a job within some time is what a team asks for.

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
# A cost objective's default floor: this fraction of the fastest plan's tokens/s (--min-speed).
DEFAULT_MIN_SPEED = 0.5
# "cost" ranks by $/hour x (1 + seconds per iteration x TIE): layouts of equally priced GPUs (many
# share a GPU count) go to the faster, and the scan prunes among them by time.
TIE = 1e-9


@dataclass
class Objective:
    name: str = "throughput"
    max_cost_per_hour: float | None = None
    min_tokens_per_s: float | None = None
    min_speed: float | None = None     # fraction of the fastest plan's tokens/s; None: the default
    _rates: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.name not in price.OBJECTIVES:
            raise GeotrainError(f"unknown objective {self.name!r} (known: {', '.join(price.OBJECTIVES)})")
        for flag, v in (("--max-cost-per-hour", self.max_cost_per_hour),
                        ("--min-tokens-per-s", self.min_tokens_per_s)):
            if v is not None and not (math.isfinite(v) and v > 0):
                raise GeotrainError(f"{flag} must be a positive number (got {v})")
        if self.min_speed is not None and not (0 <= self.min_speed <= 1):
            raise GeotrainError(f"--min-speed must be a fraction in [0, 1] (got {self.min_speed})")
        if self.min_speed is None:
            self.min_speed = DEFAULT_MIN_SPEED if self.name != "throughput" and self.min_tokens_per_s is None else 0.0

    def floored(self, fastest_tokens_per_s: float) -> Objective:
        """This objective with its floor in tokens/s, given the fastest plan's: the larger of
        --min-tokens-per-s and min_speed x the fastest."""
        floor = max(self.min_tokens_per_s or 0.0, self.min_speed * fastest_tokens_per_s)
        return Objective(self.name, self.max_cost_per_hour, floor or None, 0.0, self._rates)

    def time_limit(self, tokens_per_iteration: float) -> float:
        """The estimate beyond which a candidate misses the floor even with the estimate's slack."""
        if self.min_tokens_per_s is None:
            return math.inf
        return tokens_per_iteration * CONSTRAINT_SLACK / self.min_tokens_per_s

    def meets_floor(self, tokens_per_iteration: float, t: float, slack: float = 1.0) -> bool:
        return self.min_tokens_per_s is None or tokens_per_iteration / t * slack >= self.min_tokens_per_s

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
        return rate * (1 + time_bound * TIE) if self.name == "cost" else rate * time_bound / 3600

    def time_cutoff(self, ctx: PlanningContext, lay: Layout, key_cutoff: float) -> float:
        """The estimate beyond which a candidate of this layout cannot beat `key_cutoff`."""
        if self.name == "throughput":
            return key_cutoff
        rate = self.gpu_rate(ctx, lay)
        if not math.isfinite(key_cutoff) or not rate > 0:
            return math.inf
        return (key_cutoff / rate - 1) / TIE if self.name == "cost" else key_cutoff * 3600 / rate

    def key(self, ctx: PlanningContext, cand: Candidate) -> float:
        """The objective's value of a candidate's estimate (inf where it breaks a constraint)."""
        t = cand.est.total
        if not self.meets_floor(ctx.job.global_batch * ctx.model.seq_len, t, CONSTRAINT_SLACK):
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
            return hour * (1 + t * TIE)
        return t if self.name == "throughput" else rate * t / 3600 + egress
