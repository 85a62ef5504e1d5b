"""The planner: search layouts with the analytical estimate, confirm the best with the simulator.

Search space (pruned so 4 DCs x 8,192 GPUs plans in seconds):
  chain of DCs (simple paths of the WAN graph) x dp (divisors of the batch) x pp (every small
  value, then a x1.25 ladder) x micro-batch (divisors from 1..16) -- each such *layout* gets a
  cheap lower bound (ideal compute of its GPUs, WAN bytes over capacity, WAN latency), layouts
  are scored in lower-bound order and the scan stops once the bound exceeds the best estimate;
  for a scored layout: checkpointing (cheapest that fits first), schedule kind, sharding
  (cheapest that fits), temporal vs fair WAN sharing; stage counts per DC go fastest GPUs first
  and the layer split is balanced per stage time (split.py), cached per GPU-type sequence.
The `top_k` best estimates -- plus, so the result is never worse than a baseline, the upgraded
baseline layouts -- are simulated, and the fastest simulated plan wins.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from geotrain.config.load import Spec
from geotrain.errors import InfeasibleError
from geotrain.plan.context import GBIT, PlanningContext
from geotrain.plan.estimate import BoundaryCosts, Estimate, StageCosts, estimate, finish, inflight, pipeline_part
from geotrain.plan.pins import pin_problem, respects_pins
from geotrain.plan.placement import chains, distribute_ranked, iter_dp, pp_candidates, speed_ranks, stage_dcs
from geotrain.plan.plan import LinkPlan, Plan, StagePlan
from geotrain.plan.split import balanced_split, split_even
from geotrain.plan.temporal import apply_fair, apply_temporal, offsets_span, pipeline_offsets, turn_rate_gbps
from geotrain.wan.temporal import concurrent_turns

MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(slots=True)
class Layout:
    """Where the GPUs come from: DC chain, stages per DC, dp, micro-batching."""

    chain: tuple[str, ...]
    counts: tuple[int, ...]
    dp: int
    micro_batch: int
    m: int
    bound: float = 0.0

    @property
    def pp(self) -> int:
        return sum(self.counts)

    @property
    def stage_dcs(self) -> list[str]:
        return stage_dcs(self.chain, self.counts)


@dataclass
class Candidate:
    layout: Layout
    kind: str
    v: int
    checkpointing: str
    sharding: str
    chunks: tuple[tuple[tuple[int, int], ...], ...]
    extra: tuple[int, ...]
    sharing: str
    connections: tuple[int, ...]
    est: Estimate
    name: str = "geotrain"

    def to_plan(self, ctx: PlanningContext) -> Plan:
        lay = self.layout
        dcs = lay.stage_dcs
        stages = tuple(StagePlan(dc=dc, chunks=ch) for dc, ch in zip(dcs, self.chunks, strict=True))
        links = tuple(LinkPlan(src_dc=a, dst_dc=b, connections=n, sharing="fair")
                      for (a, b), n in zip(zip(lay.chain, lay.chain[1:]), self.connections, strict=True))
        plan = Plan(stages=stages, dp=lay.dp, micro_batch=lay.micro_batch, num_microbatches=lay.m,
                    schedule=self.kind, tp=ctx.tp, precision=ctx.job.precision,
                    checkpointing=self.checkpointing, sharding=self.sharding, links=links,
                    extra_warmup=self.extra if self.kind == "wan-1f1b" else (), name=self.name)
        if self.sharing == "temporal":
            return apply_temporal(plan, ctx.cluster, ctx.boundary_bytes(lay.micro_batch), self.est.period)
        return apply_fair(plan)


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
    search_s: float = 0.0
    simulate_s: float = 0.0

    @property
    def iteration_s(self) -> float:
        return self.sim.metrics.iteration_time if self.sim is not None else self.estimate_s


def schedule_kinds(ctx: PlanningContext, chain_len: int) -> tuple[str, ...]:
    from geotrain.schedule.builders import BUILDERS

    if ctx.job.schedule != "auto":
        return (ctx.job.schedule,)
    kinds = ["1f1b", "zb-h1"]
    if chain_len > 1:
        kinds.append("wan-1f1b")
    else:
        kinds.append("interleaved")  # its chunk order wraps last->first stage: only inside one DC
    return tuple(k for k in kinds if k in BUILDERS)


class Scorer:
    """Scores layouts; owns the split cache."""

    def __init__(self, ctx: PlanningContext, wan_aware: bool = True, fixed_connections: int | None = None,
                 sharing: tuple[str, ...] = ("temporal", "fair"), kinds: tuple[str, ...] | None = None,
                 even_split: bool = False):
        self.ctx = ctx
        self.wan_aware = wan_aware
        self.fixed_connections = fixed_connections
        self.sharing = sharing
        self.kinds = kinds
        self.even_split = even_split
        self._splits: dict[tuple, tuple[tuple[tuple[int, int], ...], ...]] = {}
        self._compute: dict[tuple, list] = {}
        self.scored = 0
        self.tightest: tuple[float, str, str] | None = None  # (memory fraction, DC, layout) nearest to fitting

    # -- pieces ------------------------------------------------------------------------------
    def split(self, dcs: list[str], mb: int, ckpt: str, v: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        ctx = self.ctx
        types = tuple(ctx.dc(d).gpu_type for d in dcs)
        key = (types, mb, ckpt, v, self.even_split)
        out = self._splits.get(key)
        if out is None:
            pp = len(dcs)
            if self.even_split:
                ranges = split_even(ctx.num_units, pp * v)
            else:
                prefixes = [ctx.table(types[i % pp], mb, ckpt).step for i in range(pp * v)]
                ranges = balanced_split(prefixes)
            out = tuple(tuple(ranges[c * pp + s] for c in range(v)) for s in range(pp))
            self._splits[key] = out
        return out

    def stage_costs(self, dcs: list[str], chunks, mb: int, ckpt: str, sharding: str, dp: int) -> list[StageCosts]:
        ctx = self.ctx
        return [StageCosts(f, b, bi, bw, ctx.allreduce(ch, dp, dc, sharding), ctx.optimizer(ch, dc, sharding, dp))
                for (f, b, bi, bw), ch, dc in zip(self._compute_only(dcs, chunks, mb, ckpt), chunks, dcs, strict=True)]

    def connections(self, a: str, b: str, dp: int, sharing: str) -> int:
        link = self.ctx.link(a, b)
        if self.fixed_connections is not None:
            return self.fixed_connections
        sat = link.connections_to_saturate()
        return sat if sharing == "temporal" or dp <= 1 else max(1, math.ceil(sat / dp))

    def boundaries(self, lay: Layout, sharing: str, conns: tuple[int, ...],
                   v: int) -> tuple[list[BoundaryCosts], float]:
        """Per physical boundary costs; also the temporal stagger (one micro-batch at full rate)."""
        ctx = self.ctx
        dcs = lay.stage_dcs
        nbytes = ctx.boundary_bytes(lay.micro_batch)
        dp = lay.dp
        out, stagger, wan_i = [], 0.0, 0
        for s in range(len(dcs) - 1):
            a, b = dcs[s], dcs[s + 1]
            if a == b:
                out.append(BoundaryCosts(False, ctx.intra_dc_transfer(a, nbytes), 0.0))
                continue
            link = ctx.link(a, b)
            n = conns[wan_i]
            wan_i += 1
            lat = link.latency_ms * 1e-3
            if sharing == "temporal" and dp > 1:
                # Work-conserving turns: a few transfers at once fill the link (concurrent_turns).
                rate = turn_rate_gbps(link, n, dp) * GBIT
                slots = min(dp, concurrent_turns(link.capacity_gbps, link.rate_gbps(n)))
                delay = lat + nbytes / rate
                occ = dp * nbytes / (slots * rate)
                stagger = max(stagger, nbytes / rate)
            else:
                agg = min(dp * link.rate_gbps(n), link.capacity_gbps) * GBIT
                delay = lat + nbytes * dp / agg
                occ = dp * nbytes / agg
            if not self.wan_aware:
                delay, occ = 0.0, 0.0
            out.append(BoundaryCosts(True, delay, occ, f"{a}->{b}"))
        return out, stagger

    # -- a layout ------------------------------------------------------------------------------
    def score(self, lay: Layout, kinds: tuple[str, ...] | None = None) -> Candidate | None:
        """The best (schedule kind, checkpointing, sharding, WAN sharing) for a layout, or None
        if nothing fits. Heavier checkpointing is tried only when no kind fits with a lighter one."""
        ctx = self.ctx
        dcs = lay.stage_dcs
        pp, m, dp = lay.pp, lay.m, lay.dp
        kinds = kinds or self.kinds or schedule_kinds(ctx, len(lay.chain))
        wan_lat = sum(ctx.link(a, b).latency_ms * 1e-3 for a, b in zip(lay.chain, lay.chain[1:]))
        # Temporal only where it can differ: some link whose turns hold fewer than dp transfers.
        sharings = self.sharing if len(lay.chain) > 1 and dp > 1 and any(
            concurrent_turns(ctx.link(a, b).capacity_gbps, ctx.link(a, b).rate_gbps(
                self.connections(a, b, dp, "temporal"))) < dp for a, b in zip(lay.chain, lay.chain[1:])) else ("fair",)
        variants = []
        for sharing in sharings:
            conns = tuple(self.connections(a, b, dp, sharing) for a, b in zip(lay.chain, lay.chain[1:]))
            bounds, stagger = self.boundaries(lay, sharing, conns, 1)
            variants.append((sharing, conns, bounds, stagger))
        best: Candidate | None = None
        for ckpt in ctx.checkpointing_options():
            for kind in kinds:
                v = 2 if kind == "interleaved" else 1
                if v > 1 and (pp < 2 or m % pp or ctx.num_units < pp * v):
                    continue
                if kind == "wan-1f1b" and len(lay.chain) < 2:
                    continue
                if kind == "zb-h1" and ckpt == "selective":
                    continue  # the split backward runs twice through a checkpointed region: PyTorch refuses
                chunks = self.split(dcs, lay.micro_batch, ckpt, v)
                compute = self.compute_costs(dcs, chunks, lay.micro_batch, ckpt)
                for sharing, conns, bounds, stagger in variants:
                    cand = self._fit_and_estimate(lay, kind, v, ckpt, chunks, compute, bounds, stagger, sharing,
                                                  conns, wan_lat)
                    if cand is not None and (best is None or cand.est.total < best.est.total):
                        best = cand
            if best is not None:
                break  # heavier checkpointing only adds recompute
        return best

    def compute_costs(self, dcs, chunks, mb: int, ckpt: str) -> list[tuple[float, float, float, float]]:
        key = (tuple(dcs), chunks, mb, ckpt)
        hit = self._compute.get(key)
        if hit is None:
            hit = [c[:4] for c in self._compute_only(dcs, chunks, mb, ckpt)]
            self._compute[key] = hit
        return hit

    def _compute_only(self, dcs, chunks, mb, ckpt):
        ctx = self.ctx
        out = []
        for dc, ch in zip(dcs, chunks, strict=True):
            tab = ctx.table(ctx.dc(dc).gpu_type, mb, ckpt)
            f = b = bi = bw = 0.0
            for a, e in ch:
                tf, tb, tbi, tbw = tab.times(a, e)
                f, b, bi, bw = f + tf, b + tb, bi + tbi, bw + tbw
            if ctx.tp > 1:
                c = ctx.tp_comm(ch, mb, dc) / 2
                f, b, bi = f + c, b + c, bi + c
            out.append((f, b, bi, bw))
        return out

    def _fit_and_estimate(self, lay, kind, v, ckpt, chunks, compute, bounds, stagger, sharing, conns, wan_lat):
        ctx = self.ctx
        dcs = lay.stage_dcs
        pp, m, mb, dp = lay.pp, lay.m, lay.micro_batch, lay.dp
        extra: tuple[int, ...] = ()
        if kind == "wan-1f1b":
            extra = self._wanted_warmup(compute, bounds, m)
            if not any(extra):
                return None  # identical to 1f1b
        wanted = extra
        best: Candidate | None = None
        parts: dict[tuple[int, ...], tuple] = {}   # the sharding only changes the tail: per warm-up, once
        for sharding in ctx.sharding_options():
            # Every sharding that fits is scored, not only the leanest: sharding the optimizer
            # state also shards the optimizer step, which can make a heavier one faster.
            if kind == "wan-1f1b":
                extra = self._fit_warmup(lay, chunks, wanted, sharding, ckpt)
                if not any(extra):
                    continue
            if not all(ctx.stage_fits(chunks[s], dcs[s], mb, inflight(kind, pp, m, s, extra, v), sharding, dp, ckpt)
                       for s in range(pp)):
                continue
            self.scored += 1
            costs = [StageCosts(f, b, bi, bw, ctx.allreduce(ch, dp, dc, sharding), ctx.optimizer(ch, dc, sharding, dp))
                     for (f, b, bi, bw), ch, dc in zip(compute, chunks, dcs, strict=True)]
            hit = parts.get(extra)
            if hit is None:
                part = pipeline_part(costs, bounds, m, kind, v, extra)
                span = offsets_span(dp, stagger, part.period) if sharing == "temporal" else 0.0
                hit = parts[extra] = (part, span)
            est = finish(hit[0], costs, bounds, hit[1], wan_lat)
            if best is None or est.total < best.est.total:
                best = Candidate(lay, kind, v, ckpt, sharding, chunks, extra, sharing, conns, est)
        if best is not None:
            return best
        if self.scored == 0:
            self._record_miss(lay, kind, v, ckpt, chunks, extra)
        return None

    def _record_miss(self, lay, kind, v, ckpt, chunks, extra) -> None:
        ctx = self.ctx
        sharding = ctx.sharding_options()[-1]
        dcs = lay.stage_dcs
        frac, dc = max((ctx.stage_memory_fraction(chunks[s], dcs[s], lay.micro_batch,
                                                  inflight(kind, lay.pp, lay.m, s, extra, v), sharding, lay.dp, ckpt),
                        dcs[s]) for s in range(lay.pp))
        if self.tightest is None or frac < self.tightest[0]:
            desc = (f"pp={lay.pp}, dp={lay.dp}, micro-batch {lay.micro_batch}, {kind}, "
                    f"checkpointing {ckpt}, sharding {sharding}")
            self.tightest = (frac, dc, desc)

    def _wanted_warmup(self, compute, bounds, m: int) -> tuple[int, ...]:
        """Extra warm-up forwards the WAN round trips call for (memory not yet considered)."""
        from geotrain.schedule.wan import wan_extra_warmup

        pp = len(compute)
        delays = [b.delay if b.wan else 0.0 for b in bounds]
        cap = [min(m, 4 * pp + 64)] * pp
        return tuple(wan_extra_warmup(pp, [c[0] for c in compute], [c[1] for c in compute], delays, cap))

    def _fit_warmup(self, lay, chunks, wanted, sharding, ckpt) -> tuple[int, ...]:
        """Lower each stage's extra warm-up until its activations fit (memory is monotone in it),
        keeping the warm-up non-increasing along the pipeline as the builder requires."""
        ctx = self.ctx
        dcs = lay.stage_dcs
        pp = lay.pp
        extra = list(wanted)
        for s in range(pp):
            base = pp - s
            lo, hi = 0, extra[s]
            if hi and not ctx.stage_fits(chunks[s], dcs[s], lay.micro_batch, min(lay.m, base + hi), sharding,
                                         lay.dp, ckpt):
                hi -= 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if ctx.stage_fits(chunks[s], dcs[s], lay.micro_batch, min(lay.m, base + mid), sharding,
                                      lay.dp, ckpt):
                        lo = mid
                    else:
                        hi = mid - 1
                extra[s] = lo
        for s in range(pp - 1):
            extra[s + 1] = min(extra[s + 1], extra[s] + 1)
        return tuple(extra)


# -- layout enumeration --------------------------------------------------------------------------
def enumerate_layouts(ctx: PlanningContext, allowed_chains: list[tuple[str, ...]] | None = None,
                      wan_aware: bool = True) -> list[Layout]:
    """Every (chain, dp, pp, micro-batch) the job allows, each with a lower bound on its time."""
    job, cluster = ctx.job, ctx.cluster
    tp = ctx.tp
    gb = job.global_batch
    mbs = [job.micro_batch] if isinstance(job.micro_batch, int) else [b for b in MICRO_BATCHES if gb % b == 0]
    out = []
    seen: set[tuple] = set()   # (what the chain looks like, counts, dp, mb): alike DCs swapped are one layout
    for chain in allowed_chains or chains(cluster):
        look = chain_signature(ctx, chain)
        gpus = [cluster.dc(d).gpus for d in chain]
        types = [cluster.dc(d).gpu_type for d in chain]
        if job.pp is not None and job.pp < len(chain):
            continue
        kinds = schedule_kinds(ctx, len(chain))
        for mb in mbs:
            # Ideal per-micro-batch work of the whole model on each DC's GPU type, and the least
            # fill/drain any allowed schedule can have (both split-independent sums over units).
            tabs = [ctx.table(t, mb, ctx.checkpointing_options()[0]) for t in types]
            work = [tab.step[-1] for tab in tabs]
            speeds = [1.0 / w for w in work]
            ranks = speed_ranks(speeds)
            fills = []
            for kind in kinds:
                if kind == "zb-h1":
                    fills.append(min(t.forward[-1] + t.backward_input[-1] - t.backward_weight[-1] for t in tabs))
                elif kind == "interleaved":
                    fills.append(min(work) / 2)
                else:
                    fills.append(min(work))
            fill = min(fills, default=0.0)
            nbytes = ctx.boundary_bytes(mb)
            caps_bw = [ctx.link(a, b).capacity_gbps * GBIT for a, b in zip(chain, chain[1:])]
            lat = sum(ctx.link(a, b).latency_ms * 1e-3 for a, b in zip(chain, chain[1:]))
            for dp in iter_dp(gb, mb, min(gpus) // tp):
                if job.dp is not None and dp != job.dp:
                    continue
                caps = tuple(g // (dp * tp) for g in gpus)
                m = gb // (dp * mb)
                hi = min(sum(caps), ctx.model.layers)
                pps = [job.pp] if job.pp is not None else pp_candidates(len(chain), hi)
                wan_period = dp * nbytes / min(caps_bw) if wan_aware and caps_bw else 0.0
                extra = 2 * lat if wan_aware and caps_bw else 0.0
                for pp in pps:
                    counts = distribute_ranked(pp, caps, ranks)
                    if counts is None:
                        continue
                    key = (look, counts, dp, mb)
                    if key in seen:
                        continue
                    seen.add(key)
                    period = 1.0 / sum(c * sp for c, sp in zip(counts, speeds))
                    if period < wan_period:
                        period = wan_period
                    out.append(Layout(chain, counts, dp, mb, m, (m - 1) * period + fill + extra))
    return out


def search(ctx: PlanningContext, scorer: Scorer, layouts: list[Layout], keep: int = 8,
           deadline_s: float | None = None) -> list[Candidate]:
    """Score layouts in lower-bound order until the bound passes the keep-th best estimate."""
    layouts = sorted(layouts, key=lambda lay: lay.bound)
    best: list[Candidate] = []
    t0 = time.perf_counter()
    for lay in layouts:
        if len(best) >= keep and lay.bound >= best[-1].est.total:
            break
        if deadline_s is not None and best and time.perf_counter() - t0 > deadline_s:
            break
        cand = scorer.score(lay)
        if cand is None:
            continue
        best.append(cand)
        best.sort(key=lambda c: c.est.total)
        # Keep distinct layouts only (same chain/counts/dp/mb already there: keep the better).
        del best[keep:]
    return best


def _diagnose_infeasible(ctx: PlanningContext, scorer: Scorer | None = None) -> str:
    """One line saying what is missing when no layout fits."""
    from geotrain.plan.explain import infeasible_reason

    return infeasible_reason(ctx, scorer.tightest if scorer is not None else None)


def make_plan(spec: Spec, *, top_k: int = 3, progress: bool = False, simulate: bool = True,
              log: Callable[[str], None] | None = None) -> PlanResult:
    """Search, then simulate the `top_k` best estimates (and the upgraded baselines) and keep
    the fastest simulated plan."""
    from geotrain.plan.explain import analyse

    t0 = time.perf_counter()
    ctx = PlanningContext(spec)
    problem = pin_problem(ctx)
    if problem:
        raise InfeasibleError(problem)
    scorer = Scorer(ctx)
    layouts = enumerate_layouts(ctx)
    if not layouts:
        raise InfeasibleError(_diagnose_infeasible(ctx))
    cands = search(ctx, scorer, layouts, keep=max(top_k, 1) * 2)
    if not cands:
        raise InfeasibleError(_diagnose_infeasible(ctx, scorer))
    finalists = _distinct(cands, ctx)[:max(top_k, 1)]
    plans = [(c.to_plan(ctx), c) for c in finalists]
    # Variants of the best: the other sharing policy, and the baselines upgraded with our WAN use.
    best = finalists[0]
    if best.sharing == "temporal":  # fair where temporal does not pay; start offsets where they do
        plans.append((apply_fair(best.to_plan(ctx)).with_(name=f"{best.name}-fair"), best))
        plans.append((apply_temporal(best.to_plan(ctx), ctx.cluster, ctx.boundary_bytes(best.layout.micro_batch),
                                     best.est.period, offsets=True).with_(name=f"{best.name}-offsets"), best))
    # A baseline picks its own dp, schedule, ...: for a pinned job only those keeping the pins count.
    plans += [(p, None) for p in _upgraded_baselines(spec, ctx) if respects_pins(p, spec.job)]
    plans = _worth_simulating(ctx, plans, best.est.total)
    t_search = time.perf_counter() - t0
    if log:
        log(f"searched {len(layouts)} layouts, scored {scorer.scored} candidates in {t_search:.2f} s")
    chosen_plan, chosen_cand, chosen_sim, finals = plans[0][0], plans[0][1], None, []
    t1 = time.perf_counter()
    if simulate:
        from geotrain.sim import simulate as run_sim

        best_t = math.inf
        simulated = []
        for plan, cand in plans:
            res = run_sim(spec, plan, iterations=1, progress=progress)
            t = res.metrics.iteration_time
            simulated.append((plan, t))
            finals.append((plan.name, cand.est.total if cand else float("nan"), t))
            if log:
                log(f"simulated {plan.name} ({plan.pp} stages x dp {plan.dp}, {plan.schedule}): {t:.3f} s")
            if t < best_t:
                best_t, chosen_plan, chosen_cand, chosen_sim = t, plan, cand, res
    t_sim = time.perf_counter() - t1
    if chosen_cand is None:
        chosen_cand = score_plan(ctx, chosen_plan)
    # Candidates are numbered internally ("geotrain-3"); the plan a user gets is named after the experiment.
    chosen_plan = chosen_plan.with_(name=spec.name)
    if chosen_sim is not None:
        chosen_sim.plan = chosen_plan
    lb, lb_parts, bottleneck, expl = analyse(ctx, chosen_plan, chosen_cand, chosen_sim)
    if simulate and chosen_sim is not None:
        expl = expl + _cheaper_alternative(chosen_plan, chosen_sim.metrics.iteration_time, simulated)
    return PlanResult(plan=chosen_plan, estimate_s=chosen_cand.est.total if chosen_cand else float("nan"),
                      sim=chosen_sim, lower_bound_s=lb, bottleneck=bottleneck, explanation=expl,
                      candidates_scored=scorer.scored, estimate=chosen_cand.est if chosen_cand else None,
                      lower_bound_parts=lb_parts, finalists=finals, search_s=t_search, simulate_s=t_sim)


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
        key = plan.with_(name="")
        if key in seen:
            continue
        if cand is None:
            est = score_plan(ctx, plan)
            if est is not None and est.est.total > slack * best_estimate:
                continue
        seen.add(key)
        out.append((plan, cand))
    return out


def chain_signature(ctx: PlanningContext, chain: tuple[str, ...]) -> tuple:
    """What the simulator sees of a chain: per DC its hardware, per hop the link's numbers -- two
    chains over alike DCs (two equal zones swapped) give the same layouts. Prices are part of it,
    so alike DCs at different prices stay apart."""
    def dc(name: str) -> tuple:
        d = ctx.dc(name)
        return (d.gpu_type, d.gpus_per_node, d.intra_node_gbps, d.intra_dc_gbps, d.intra_dc_latency_us,
                d.price_per_gpu_hour)

    hops = tuple((lk.latency_ms, lk.capacity_gbps, lk.per_connection_gbps, lk.max_connections, lk.loss, lk.jitter_ms)
                 for lk in (ctx.link(a, b) for a, b in zip(chain, chain[1:])))
    return tuple(dc(x) for x in chain), hops


def _signature(ctx: PlanningContext, c: Candidate) -> tuple:
    return (chain_signature(ctx, c.layout.chain), c.layout.counts, c.layout.dp, c.layout.micro_batch, c.kind,
            c.sharing, c.checkpointing, c.sharding)


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
    from geotrain.plan.baselines import pipeline_baselines

    out = []
    for name, plan in pipeline_baselines(spec, ctx).items():
        if plan is None:
            continue
        conns = [ctx.link(lp.src_dc, lp.dst_dc).connections_to_saturate() for lp in plan.links]
        from geotrain.plan.temporal import with_connections

        up = with_connections(plan, conns).with_(name=f"{name}+wan")
        cand = score_plan(ctx, up)
        period = cand.est.period if cand else 0.0
        up = apply_temporal(up, ctx.cluster, ctx.boundary_bytes(up.micro_batch), period)
        out.append(up)
        if name == "single-dc":
            out.append(plan.with_(name="single-dc"))
    return out


def score_plan(ctx: PlanningContext, plan: Plan) -> Candidate | None:
    """The analytical estimate of an existing plan (for baselines and the explanation)."""
    chain = []
    counts = []
    for st in plan.stages:
        if chain and chain[-1] == st.dc:
            counts[-1] += 1
        else:
            chain.append(st.dc)
            counts.append(1)
    lay = Layout(tuple(chain), tuple(counts), plan.dp, plan.micro_batch, plan.num_microbatches)
    sharing = "temporal" if any(lp.sharing == "temporal" for lp in plan.links) else "fair"
    scorer = Scorer(ctx, kinds=(plan.schedule,))
    conns = tuple(lp.connections for lp in plan.links)
    if len(conns) != len(chain) - 1:
        return None
    bounds, stagger = scorer.boundaries(lay, sharing, conns, plan.virtual_per_stage)
    dcs = lay.stage_dcs
    costs = scorer.stage_costs(dcs, tuple(s.chunks for s in plan.stages), plan.micro_batch, plan.checkpointing,
                               plan.sharding, plan.dp)
    wan_lat = sum(ctx.link(a, b).latency_ms * 1e-3 for a, b in zip(chain, chain[1:]))
    span = max(plan.pipeline_offsets, default=0.0)
    est = estimate(costs, bounds, plan.num_microbatches, plan.schedule, plan.virtual_per_stage, plan.extra_warmup,
                   span, wan_lat)
    return Candidate(lay, plan.schedule, plan.virtual_per_stage, plan.checkpointing, plan.sharding,
                     tuple(s.chunks for s in plan.stages), plan.extra_warmup, sharing, conns, est, plan.name)


__all__ = ["Candidate", "Layout", "PlanResult", "Scorer", "make_plan", "pipeline_offsets"]
