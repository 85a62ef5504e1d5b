"""The planner's search: scan layouts in lower-bound order, keep the best estimates, and list the
finalists a caller confirms by simulation (geotrain.planner.confirm does, for the commands).

`search` (scan.py) scores layouts (chains.py, scorer.py) in lower-bound order until the bound
passes the keep-th best estimate. `shortlist` adds to the top-k distinct estimates their variants -- fair
sharing where temporal was picked, staggered pipeline starts -- and the PP baselines upgraded
with this planner's WAN use, less repeats and baselines the estimate puts far behind; the
simulator picks among them a level up, and `conclude` turns the pick into a PlanResult with its
lower bound, bottleneck and explanation. Nothing here simulates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from geotrain.errors import InfeasibleError
from geotrain.layout.plan import Plan
from geotrain.planner.analytic import Estimate
from geotrain.planner.baselines import pipeline_baselines
from geotrain.planner.candidate import Candidate
from geotrain.planner.chains import Layout, chain_signature, enumerate_layouts, schedule_kinds
from geotrain.planner.context import PlanningContext
from geotrain.planner.explain import analyse, infeasible_reason
from geotrain.planner.objective import Objective
from geotrain.planner.pins import pin_problem, respects_pins
from geotrain.planner.plan_score import score_plan
from geotrain.planner.scan import search, search_groups, tp_groups
from geotrain.planner.scorer import Scorer
from geotrain.planner.sharing import apply_fair, apply_temporal, with_connections
from geotrain.spec.load import Spec

ESTIMATE_BAND = 0.07     # how far behind the best estimate a candidate may be and still be simulated
EXTRA_FINALISTS = 2      # ... at most this many beyond top_k


@dataclass
class PlanResult:
    plan: Plan
    estimate_s: float
    sim: object | None               # geotrain.sim.SimResult
    lower_bound_s: float
    bottleneck: str
    explanation: list[str]
    candidates_scored: int
    estimate: Estimate | None = None
    lower_bound_parts: dict[str, float] = field(default_factory=dict)
    finalists: list[tuple[str, float, float]] = field(default_factory=list)  # (name, estimate, simulated)
    simulated: list[tuple[Plan, float]] = field(default_factory=list)         # every finalist, simulated s
    chosen_index: int = 0
    search_s: float = 0.0
    simulate_s: float = 0.0
    modes: list = field(default_factory=list)     # planner.modes.ModeRow per cross-DC mode, where compared

    @property
    def iteration_s(self) -> float:
        return self.sim.iteration_time if self.sim is not None else self.estimate_s


@dataclass
class Shortlist:
    """What the search hands up for confirmation: the finalists (plan, its candidate or None for
    a baseline), in the order ties are broken."""

    spec: Spec
    ctx: PlanningContext
    plans: list[tuple[Plan, Candidate | None]]
    layouts: int
    scored: int
    search_s: float
    ctxs: dict[tuple, PlanningContext] = field(default_factory=dict)   # per tp assignment searched (ctx.key)
    groups: list = field(default_factory=list)                          # scan.tp_groups, for a second scan

    def ctx_for(self, plan: Plan) -> PlanningContext:
        """The context pricing this plan's stages at their tp (the costs are per tp)."""
        ctx = self.ctx.for_plan(plan)
        return self.ctxs.setdefault(ctx.key, ctx)


def _diagnose_infeasible(ctx: PlanningContext, scorer: Scorer | None = None) -> str:
    """One line saying what is missing when no layout fits."""
    return infeasible_reason(ctx, scorer.tightest if scorer is not None else None)


def shortlist(spec: Spec, top_k: int = 3, profile: dict | None = None, objective: Objective | None = None) -> Shortlist:
    """Search, and list the `top_k` best distinct estimates with their variants and the upgraded
    baselines, for a caller to simulate; with a cost objective or a budget (planner.objective)
    the caller then adds `money_finalists`, so it picks from the fastest and the cheapest (a
    Pareto set), not from the fastest re-ranked."""
    t0 = time.perf_counter()
    groups = tp_groups(spec, profile)      # one per tensor-parallel degree; the smallest first
    ctx, scorer, _ = groups[0]
    problem = pin_problem(ctx)
    if problem:
        raise InfeasibleError(problem)
    layouts = sum(len(g[2]) for g in groups)
    if not layouts:
        raise InfeasibleError(_diagnose_infeasible(ctx))
    # Under a cost objective the fastest plan only sets the throughput floor and shows what the
    # cheaper one gives up: its best estimate and the baselines are simulated, not its runners-up.
    by_money = objective is not None and objective.name != "throughput"
    cands = search_groups(groups, keep=1 if by_money else max(top_k, 1) * 2)
    if not cands:
        raise InfeasibleError(_diagnose_infeasible(ctx, scorer))
    distinct = _distinct(cands, ctx)
    finalists = distinct[:max(top_k, 1)]
    # The estimate is off by up to ~7% against the simulator (fill/drain and turn-taking details):
    # a few more candidates inside that band are simulated too, so the search does not miss one
    # the simulator ranks first (a small line cluster: the 4th estimate was the optimum).
    band = finalists[0].est.total * (1 + ESTIMATE_BAND)
    finalists += [c for c in distinct[len(finalists):] if c.est.total <= band][:EXTRA_FINALISTS]
    plans = [(c.to_plan(ctx), c) for c in finalists]
    best = finalists[0]
    if not by_money and best.sharing == "temporal":  # fair where temporal does not pay; offsets where they do
        plans.append((apply_fair(best.to_plan(ctx)).with_(name=f"{best.name}-fair"), best))
        plans.append((apply_temporal(best.to_plan(ctx), ctx.cluster, ctx.boundary_bytes(best.layout.micro_batch),
                                     best.est.period, offsets=True).with_(name=f"{best.name}-offsets"), best))
    # The scorer keeps one schedule kind per layout; the estimate ranks kinds within a few per cent
    # of each other (a 2-DC case: wan-1f1b estimated first, zb-h1 simulated 2% faster), so the best
    # layout's other kinds within the band are simulated too.
    scorer_of = {g[0].key: g[1] for g in groups}
    for kind in () if by_money else schedule_kinds(ctx, len(best.layout.chain)):
        if kind != best.kind:
            other = scorer_of[best.tps].score(best.layout, kinds=(kind,))
            if other is not None and other.est.total <= band:
                other.name = f"{best.name}-{kind}"
                plans.append((other.to_plan(scorer_of[best.tps].ctx), other))
    # A baseline picks its own dp, schedule, ...: for a pinned job only those keeping the pins count.
    plans += [(p, None) for p in _upgraded_baselines(spec, ctx) if respects_pins(p, spec.job)]
    plans = _worth_simulating(ctx, plans, best.est.total)
    return Shortlist(spec, ctx, plans, layouts, sum(g[1].scored for g in groups), time.perf_counter() - t0,
                     {g[0].key: g[0] for g in groups}, groups)


def money_finalists(short: Shortlist, objective: Objective, fastest_tokens_per_s: float,
                    top_k: int = 3) -> list[tuple[Plan, Candidate]]:
    """The `top_k` best distinct candidates of a second scan ranked by a cost objective or under a
    budget (planner.objective), its floor set from the fastest plan's tokens/s -- the simulated
    one where the caller simulates, so the search and the final choice hold the same floor --
    put first in the shortlist (ties go to them) and returned, less plans already listed."""
    t0 = time.perf_counter()
    ctx = short.ctx
    tokens = ctx.job.global_batch * ctx.model.seq_len
    goal, strict = objective.floored(fastest_tokens_per_s), []
    ranked = _distinct(search_groups(short.groups, keep=max(top_k, 1) * 2, objective=goal, strict=strict),
                       ctx)[:max(top_k, 1)]
    if strict and not any(goal.meets_floor(tokens, c.est.total) for c in ranked):
        ranked.append(strict[0])     # one the estimate puts over the floor, should the rest fall under
    listed = {_plan_key(p) for p, _ in short.plans}
    out = []
    for i, c in enumerate(ranked):
        c.name = f"geotrain-{objective.name}-{i + 1}"
        plan = c.to_plan(ctx)
        if _plan_key(plan) not in listed:
            listed.add(_plan_key(plan))
            out.append((plan, c))
    short.plans = out + short.plans
    short.scored = sum(g[1].scored for g in short.groups)
    short.search_s += time.perf_counter() - t0
    return out


def conclude(short: Shortlist, index: int, sim=None, simulated: list[tuple[Plan, float]] | None = None,
             simulate_s: float = 0.0) -> PlanResult:
    """The PlanResult for finalist `index` (the simulator's pick, or 0 without simulation)."""
    spec = short.spec
    plan, cand = short.plans[index]
    ctx = short.ctx_for(plan)
    if cand is None:
        cand = score_plan(ctx, plan)
    # Candidates are numbered internally ("geotrain-3"); the plan a user gets is named after the experiment.
    plan = plan.with_(name=spec.name)
    if sim is not None:
        sim.plan = plan
    lb, lb_parts, bottleneck, expl = analyse(ctx, plan, cand, sim)
    finals = []
    if simulated:
        expl = expl + _cheaper_alternative(plan, sim.iteration_time, simulated)
        finals = [(p.name, c.est.total if c else float("nan"), t)
                  for (p, c), (_, t) in zip(short.plans, simulated, strict=True)]
    return PlanResult(plan=plan, estimate_s=cand.est.total if cand else float("nan"), sim=sim, lower_bound_s=lb,
                      bottleneck=bottleneck, explanation=expl, candidates_scored=short.scored,
                      estimate=cand.est if cand else None, lower_bound_parts=lb_parts, finalists=finals,
                      search_s=short.search_s, simulate_s=simulate_s, simulated=list(simulated or []),
                      chosen_index=index)


def _cheaper_alternative(chosen: Plan, t_chosen: float, simulated: list[tuple[Plan, float]],
                         slack: float = 0.03) -> list[str]:
    """A line naming a simulated plan that is nearly as fast (within `slack`) on clearly fewer
    GPUs: the fastest plan is the answer to "how fast", but users paying per GPU-hour also want
    to know when most of the GPUs buy almost nothing."""
    n = chosen.num_ranks
    near = [(p, t) for p, t in simulated if t <= t_chosen * (1 + slack) and p.num_ranks <= 0.9 * n]
    if not near:
        return []
    p, t = min(near, key=lambda x: (x[0].num_ranks, x[1]))
    used = ", ".join(f"{dc} {k}" for dc, k in p.gpus_per_dc().items())
    return [f"Cheaper alternative: {p.num_ranks} GPUs instead of {n} ({used}; pp {p.pp} x dp {p.dp}, {p.schedule}) "
            f"take {t:.3f} s per iteration, {100 * (t / t_chosen - 1):.1f}% slower, for "
            f"{100 * (1 - p.num_ranks * t / (n * t_chosen)):.0f}% fewer GPU-hours per token."]


def _worth_simulating(ctx: PlanningContext, plans: list[tuple[Plan, Candidate | None]], best_estimate: float,
                      slack: float = 1.5) -> list[tuple[Plan, Candidate | None]]:
    """The finalists less the repeats (the same plan under another name: single-dc+wan is
    single-dc when that DC has no link to use) and the baselines the estimate puts more than
    `slack` x behind the best (their simulations cost most of the planning time and never win)."""
    out, seen = [], set()
    for plan, cand in plans:
        key = _plan_key(plan)
        if key in seen:
            continue
        if cand is None:
            est = score_plan(ctx, plan)
            if est is not None and est.est.total > slack * best_estimate:
                continue
        seen.add(key)
        out.append((plan, cand))
    return out


def _plan_key(plan: Plan) -> Plan:
    """The plan less its name; all-zero start offsets are lockstep, the same plan as none
    (tiny_2dc's "-offsets" variant)."""
    return plan.with_(name="", pipeline_offsets=plan.pipeline_offsets if any(plan.pipeline_offsets) else ())


def _signature(ctx: PlanningContext, c: Candidate) -> tuple:
    return (chain_signature(ctx, c.layout.chain), c.layout.counts, c.layout.dp, c.layout.micro_batch, c.kind,
            c.sharing, c.checkpointing, c.sharding, c.tps, c.layout.span, c.layout.replicas)


def _distinct(cands: list[Candidate], ctx: PlanningContext | None = None) -> list[Candidate]:
    seen, out = set(), []
    for c in cands:
        key = _signature(ctx, c) if ctx is not None else (c.layout.chain, c.layout.counts, c.layout.dp,
                                                            c.layout.micro_batch, c.kind, c.sharing)
        if key not in seen:
            seen.add(key)
            out.append(c)
    for i, c in enumerate(out):
        c.name = f"geotrain-{i + 1}" if i else "geotrain"
    return out


def _upgraded_baselines(spec: Spec, ctx: PlanningContext) -> list[Plan]:
    """The PP baselines' layouts with this planner's WAN handling (saturating connections,
    temporal sharing): candidates too, so the chosen plan is never slower than a baseline."""
    out = []
    for name, plan in pipeline_baselines(spec, ctx).items():
        if plan is None:
            continue
        conns = [ctx.link(lp.src_dc, lp.dst_dc).connections_to_saturate() for lp in plan.links]
        up = with_connections(plan, conns).with_(name=f"{name}+wan")
        cand = score_plan(ctx, up)
        period = cand.est.period if cand else 0.0
        up = apply_temporal(up, ctx.cluster, ctx.boundary_bytes(up.micro_batch), period)
        out.append(up)
        if name == "single-dc":
            out.append(plan.with_(name="single-dc"))
    return out


__all__ = ["Candidate", "Layout", "PlanResult", "Scorer", "Shortlist", "conclude", "enumerate_layouts",
           "money_finalists", "search", "shortlist", "score_plan"]
