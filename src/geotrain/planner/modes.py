"""The cross-DC modes side by side, and the choice among them ([job] cross_dc, spec.cross_dc_job).

Each mode is priced per iteration (one step of every worker, so tokens per iteration are equal):
  pipeline    -- the planner's plan: stages across DCs, DP inside (Atlas); simulated;
  sync-dp     -- one flat ring all-reduce over every replica in every DC (alpha-beta: 2 (N-1)
                 latencies of the slowest WAN link, (N-1)/N of the gradients per WAN hop at the
                 link's full striped rate); analytic, from the hier-dp baseline's compute;
  hier-dp     -- reduce-scatter inside each DC, all-reduce of the shards across DCs, all-gather
                 inside (planner.baselines.dp_across_dcs); analytic;
  diloco      -- a worker per DC (or per [job.diloco] workers), each the planner's best layout
                 for its share of the batch, the outer exchange every H steps (sim.outer);
  streaming   -- DiLoCo with F fragments, each exchange overlapping an inner step, int4;
  hybrid      -- pipelines across near DCs forming a worker, DiLoCo between the groups;
  compressed  -- the pipeline plan with its WAN boundaries in fp8 / int8 (bf16 for fp32 runs).
Beside each: tokens/s, WAN bytes per token, $ per 1M tokens, and its loss cost -- zero for the
synchronous ones, else the measured gap (planner.loss_table) or "not measured".

`cross_dc = "diloco"` takes the job's own DiLoCo settings on the fastest grouping (a worker per DC,
or near groups); `"auto"` the fastest mode that trains as a plan and whose loss cost is accepted
(exact, a measured gap <= max_loss_gap, or named in cross_dc_allow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import combinations

from geotrain.costs.compression import changes_numerics
from geotrain.costs.memory import DTYPE_BYTES
from geotrain.errors import GeotrainError
from geotrain.layout import price
from geotrain.layout.plan import LinkPlan, Plan
from geotrain.layout.workers import OuterPlan
from geotrain.planner.baselines import dp_across_dcs
from geotrain.planner.context import PlanningContext
from geotrain.planner.loss_table import LossRow, lookup, table_for
from geotrain.sim import simulate

DILOCO_FAMILY = ("diloco", "streaming", "hybrid")


@dataclass
class ModeRow:
    mode: str
    label: str
    plan: Plan | None              # None: an analytic row (not trained as a plan)
    iteration_s: float
    tokens_per_s: float = 0.0
    wan_bytes: float = 0.0         # per iteration
    usd_per_mtok: float | None = None
    gap: float | None = None       # relative loss cost; 0.0: synchronous by construction
    loss_note: str = ""
    note: str = ""
    own: bool = False              # built from the job's own [job.diloco] settings
    sim: object | None = None

    @property
    def ok(self) -> bool:
        return math.isfinite(self.iteration_s)

    @property
    def exact(self) -> bool:
        return self.gap == 0.0


def _sub_spec(spec, dcs: list[str], batch: int):
    """The experiment on `dcs` alone with `batch` sequences per step: one worker's planning problem."""
    keep = set(dcs)
    cl = spec.cluster.model_copy(update={
        "datacenters": [d for d in spec.cluster.datacenters if d.name in keep],
        "wan_links": [ln for ln in spec.cluster.wan_links if set(ln.between) <= keep]})
    job = spec.job.model_copy(update={"global_batch": batch, "cross_dc": "pipeline", "boundary_compression": "none"})
    return replace(spec, cluster=cl, job=job)


def groupings(spec) -> list[tuple[str, list[list[str]]]]:
    """(mode, workers' DC groups) to try: the job's, else one worker per DC and the best split into
    equal groups of near DCs (the partition whose slowest link inside a group is fastest)."""
    given = spec.job.diloco.workers
    if given:
        return [("hybrid" if any(len(g) > 1 for g in given) else "diloco", [list(g) for g in given])]
    names = [d.name for d in spec.cluster.datacenters]
    out = [("diloco", [[n] for n in names])] if len(names) > 1 else []
    for g in range(2, len(names)):
        if len(names) % g or len(names) > 8:
            continue
        best, score = None, -1.0
        for part in _partitions(names, g):
            caps = [ln.capacity_gbps / (1 + ln.latency_ms) for grp in part for a, b in combinations(grp, 2)
                    if (ln := spec.cluster.link(a, b)) is not None]
            if len(caps) == sum(len(grp) * (len(grp) - 1) // 2 for grp in part) and min(caps) > score:
                best, score = part, min(caps)
        if best is not None:
            out.append(("hybrid", best))
    return out


def _partitions(names: list[str], g: int):
    if not names:
        yield []
        return
    first, rest = names[0], names[1:]
    for others in combinations(rest, g - 1):
        left = [n for n in rest if n not in others]
        for tail in _partitions(left, g):
            yield [[first, *others], *tail]


def diloco_plan(spec, groups: list[list[str]], plan_fn, outer_kw: dict, cache: dict | None = None
                ) -> tuple[Plan | None, str]:
    """The planner's best layout for one worker's DCs and batch share, given to every group (its
    stages on the group's DCs in the same positions), with `outer_kw` as its OuterPlan; `cache`
    keeps one worker's layout per grouping across variants."""
    w = len(groups)
    if spec.job.global_batch % w:
        return None, f"global batch {spec.job.global_batch} does not split over {w} workers"
    gpus = {d.name: d.gpus for d in spec.cluster.datacenters}
    template = min(groups, key=lambda g: sum(gpus.get(d, 0) for d in g))
    key = tuple(tuple(g) for g in groups)
    cache = {} if cache is None else cache
    if key not in cache:
        try:
            cache[key] = plan_fn(_sub_spec(spec, template, spec.job.global_batch // w)).plan
        except GeotrainError as e:
            cache[key] = f"no layout fits one worker ({e})"
    inner = cache[key]
    if isinstance(inner, str):
        return None, inner
    pos = {dc: i for i, dc in enumerate(template)}
    workers = tuple(tuple(g[pos[st.dc]] for st in inner.stages) for g in groups)
    for g, dcs in zip(groups, workers, strict=True):
        need: dict[str, int] = {}
        for s, dc in enumerate(dcs):
            need[dc] = need.get(dc, 0) + inner.dp * inner.stage_tp(s)
        short = [dc for dc, n in need.items() if n > gpus.get(dc, 0)]
        if short:
            return None, f"worker {'+'.join(g)} lacks GPUs in {', '.join(short)} for the layout"
    links = tuple(replace(lp, src_dc=g[pos[lp.src_dc]], dst_dc=g[pos[lp.dst_dc]]) for g in groups for lp in inner.links)
    plan = inner.with_(stages=tuple(replace(st, dc=dc) for st, dc in zip(inner.stages, workers[0], strict=True)),
                       links=links, outer=OuterPlan(workers=workers, **outer_kw), name=spec.name)
    return plan, ""


def _outer_kw(spec, **over) -> dict:
    d = spec.job.diloco
    kw = {"inner_steps": d.inner_steps, "fragments": d.fragments, "overlap": d.overlap, "mix": d.mix,
          "lr": d.outer_lr, "momentum": d.outer_momentum, "nesterov": d.nesterov, "compression": d.compression,
          "connections": d.connections}
    kw.update(over)
    h, f = kw["inner_steps"], kw["fragments"]
    if h % f:
        kw["fragments"] = f = max(x for x in range(1, f + 1) if h % x == 0)
    kw["overlap"] = min(kw["overlap"], max(0, h // f - 1))
    return kw


def compressed(plan: Plan, codec: str, rank: int = 0) -> Plan:
    """`plan` with every WAN boundary sent `codec` (rank > 0: low-rank)."""
    pairs = {(st.dc, nxt.dc) for st, nxt in zip(plan.stages, plan.stages[1:]) if st.dc != nxt.dc}
    have = {frozenset((lp.src_dc, lp.dst_dc)): lp for lp in plan.links}
    links = [replace(have.get(frozenset(p), LinkPlan(*p)), compression=codec, rank=rank) for p in pairs]
    links += [lp for key, lp in have.items() if key not in {frozenset(p) for p in pairs}]
    return plan.with_(links=tuple(links))


def _row(spec, mode: str, label: str, plan: Plan, **kw) -> ModeRow:
    sim = simulate(spec, plan)
    t = sim.iteration_time
    usd = price.cost_per_mtoken(spec.cluster, plan, t, spec.model.seq_len, price.egress_per_iteration(spec, plan))
    return ModeRow(mode, label, plan, t, sim.tokens_per_s, sim.metrics.wan_bytes, usd, sim=sim, **kw)


def _dp_rows(spec, ctx) -> list[ModeRow]:
    """hier-dp (the baseline) and sync-dp (a flat ring over the same replicas, alpha-beta)."""
    b = dp_across_dcs(spec, ctx)
    tokens = spec.job.global_batch * spec.model.seq_len
    hour = price.gpu_cost_per_hour(spec.cluster, b.gpus_per_dc) if b.ok else None
    hier = ModeRow("hier-dp", "hier-dp", None, b.iteration_s, b.tokens_per_s, b.wan_bytes,
                   (hour * b.iteration_s / 3600 + b.egress_usd) / tokens * 1e6 if hour is not None else None,
                   0.0, "synchronous", b.note)
    if not b.ok or len(b.replicas) < 2:
        return [hier, ModeRow("sync-dp", "sync-dp", None, math.inf, note=b.note or "one DC")]
    names = [d for d, _ in b.replicas]
    links = [ln for a, c in combinations(names, 2) if (ln := spec.cluster.link(a, c)) is not None]
    n, tp = sum(r for _, r in b.replicas), ctx.tp
    rate = min(ln.rate_gbps(ln.max_connections) for ln in links) * 1e9 / 8
    lat = max(ln.latency_ms for ln in links) * 1e-3
    sync = sum((n - 1) * lat + (n - 1) / n * nbytes * tp / rate for _, nbytes in b.collectives)
    t = b.iteration_s - b.sync_s + sync
    hop = sum((n - 1) / n * nbytes * tp for _, nbytes in b.collectives)
    wan = hop * len(names)
    egress = sum(hop / 1e9 * (ln.egress_usd_per_gb or 0.0) for ln in links[:len(names)])
    usd = (hour * t / 3600 + egress) / tokens * 1e6 if hour is not None else None
    return [ModeRow("sync-dp", "sync-dp", None, t, tokens / t, wan, usd, 0.0, "synchronous",
                    f"flat ring over {n} replicas: {2 * (n - 1)} x {lat * 1e3:g} ms"), hier]


def _loss(rows: list[LossRow], row: ModeRow, spec) -> None:
    if row.gap == 0.0:
        return
    if row.mode == "compressed":
        codec = row.plan.links[0].compression
        if not changes_numerics(codec, DTYPE_BYTES[row.plan.precision]):
            row.gap, row.loss_note = 0.0, "synchronous (no change in precision)"
            return
        hit = lookup(rows, "compressed", codec)
    else:
        o = row.plan.outer
        hit = lookup(rows, "diloco", o.compression, o.inner_steps, o.fragments)
    if hit is None:
        row.loss_note = "not measured"
        return
    row.gap = hit.gap
    other_h = row.mode != "compressed" and hit.inner_steps != row.plan.outer.inner_steps
    near = f", nearest H={hit.inner_steps}" if other_h else ""
    row.loss_note = f"measured{near} ({hit.label or hit.source})"


def evaluate_modes(spec, res, plan_fn, ctx: PlanningContext | None = None) -> list[ModeRow]:
    """Every mode's row for `spec`, `res` the planner's pipeline plan, `plan_fn(spec)` the planner
    (PlanResult) used for one worker's layout."""
    ctx = ctx or PlanningContext(spec)
    table = table_for(spec)
    rows = [ModeRow("pipeline", "pipeline", res.plan, res.iteration_s,
                    res.sim.tokens_per_s if res.sim is not None else res.plan.global_batch * spec.model.seq_len
                    / res.iteration_s, res.sim.metrics.wan_bytes if res.sim is not None else 0.0,
                    price.cost_per_mtoken(spec.cluster, res.plan, res.iteration_s, spec.model.seq_len,
                                          price.egress_per_iteration(spec, res.plan)), 0.0, "synchronous", sim=res.sim)]
    rows += _dp_rows(spec, ctx)
    d = spec.job.diloco
    cache: dict = {}
    for mode, groups in groupings(spec):
        variants = [(mode, _outer_kw(spec), True)]
        if mode == "diloco":
            if d.compression == "fp32":
                variants.append(("diloco", _outer_kw(spec, compression="int8"), False))
            f = d.fragments if d.fragments > 1 else min(4, d.inner_steps)
            if d.fragments == 1 and f > 1:
                variants.append(("streaming", _outer_kw(spec, fragments=f, overlap=1, compression="int4"), False))
        for name, kw, own in variants:
            plan, why = diloco_plan(spec, groups, plan_fn, kw, cache)
            o = kw
            label = (f"{name} H={o['inner_steps']}" + (f" F={o['fragments']}" if o["fragments"] > 1 else "")
                     + (f" {o['compression']}" if o["compression"] != "fp32" else "")
                     + (f" ({' | '.join('+'.join(g) for g in groups)})" if name == "hybrid" else ""))
            if plan is None:
                rows.append(ModeRow(name, label, None, math.inf, note=why, own=own))
                continue
            rows.append(_row(spec, "streaming" if name == "diloco" and o["fragments"] > 1 else name, label, plan,
                             own=own, note=f"{plan.num_workers} workers of pp {plan.pp} x dp {plan.dp}"))
    if res.plan.pp > 1 and any(st.dc != nxt.dc for st, nxt in zip(res.plan.stages, res.plan.stages[1:])):
        codecs = (["bf16"] if res.plan.precision == "fp32" else []) + ["fp8-e4m3", "int8"]
        for c in codecs:
            rows.append(_row(spec, "compressed", f"compressed {c}", compressed(res.plan, c)))
    for r in rows:
        if r.plan is not None:
            _loss(table, r, spec)
    return rows


def accepted(spec, row: ModeRow) -> tuple[bool, str]:
    """Whether `cross_dc = "auto"` may pick `row`, and why not."""
    job = spec.job
    if not row.ok or row.plan is None:
        return False, row.note or "not trained as a plan here"
    if row.exact:
        return True, ""
    if row.mode in job.cross_dc_allow or (row.mode == "streaming" and "diloco" in job.cross_dc_allow):
        return True, ""
    if row.gap is None:
        return False, "loss cost not measured (add a row with [job] loss_table, or allow the mode)"
    if row.gap > job.max_loss_gap:
        return False, f"loss gap {row.gap:+.2%} > max_loss_gap {job.max_loss_gap:.2%}"
    return True, ""


def choose(spec, rows: list[ModeRow]) -> tuple[ModeRow, list[str]]:
    """The row `[job] cross_dc` picks and the lines saying why."""
    want = spec.job.cross_dc
    if want == "diloco":
        own = [r for r in rows if r.own and r.ok and r.mode in DILOCO_FAMILY]
        if not own:
            why = "; ".join(f"{r.label}: {r.note}" for r in rows if r.own) or "one DC only"
            raise GeotrainError(f"cross_dc = \"diloco\": no DiLoCo layout fits ({why})")
        best = max(own, key=lambda r: r.tokens_per_s)
        return best, [f"cross_dc = diloco: {best.label}, the fastest grouping of workers for [job.diloco] "
                      f"({best.tokens_per_s:,.0f} tokens/s)"]
    ok = [(r, accepted(spec, r)) for r in rows]
    good = [r for r, (a, _) in ok if a]
    best = max(good, key=lambda r: r.tokens_per_s)
    others = [r for r in good if r is not best]
    cost = "none" if best.exact else f"{best.gap:+.2%} ({best.loss_note})" if best.gap is not None else \
        f"not measured, allowed by cross_dc_allow = {list(spec.job.cross_dc_allow)}"
    nxt = max(others, key=lambda r: r.tokens_per_s) if others else None
    lines = [f"cross_dc = auto chose {best.label}: {best.tokens_per_s:,.0f} tokens/s, loss cost {cost}"
             + (f"; {best.tokens_per_s / nxt.tokens_per_s:.2f}x the next accepted mode ({nxt.label})" if nxt else "")]
    faster = [(r, why) for r, (a, why) in ok if not a and r.ok and r.tokens_per_s > best.tokens_per_s]
    for r, why in sorted(faster, key=lambda x: -x[0].tokens_per_s)[:4]:
        lines.append(f"not {r.label} ({r.tokens_per_s / best.tokens_per_s:.2f}x as fast): {why}")
    return best, lines


def apply_cross_dc(spec, res, plan_fn):
    """The PlanResult `[job] cross_dc` asks for, from the planner's pipeline plan `res`: unchanged
    for "pipeline" (boundaries compressed as the job says), else the chosen mode's plan, its
    simulation and the reasons; `res.modes` keeps every row (plan --compare prints them)."""
    job = spec.job
    if job.cross_dc == "pipeline":
        if job.boundary_compression == "none" and job.boundary_rank == 0:
            return res
        plan = compressed(res.plan, job.boundary_compression, job.boundary_rank)
        what = f"low-rank {job.boundary_rank}" if job.boundary_rank else job.boundary_compression
        return replace(res, plan=plan, sim=simulate(spec, plan),
                       explanation=[*res.explanation, f"pipeline boundaries across DCs sent {what} ([job] "
                                    "boundary_compression; changes the numerics)"])
    rows = evaluate_modes(spec, res, plan_fn)
    row, lines = choose(spec, rows)
    if row.plan is res.plan:
        return replace(res, explanation=[*res.explanation, *lines], modes=rows)
    bottleneck = res.bottleneck
    if row.plan.outer is not None and row.sim is not None:
        out = row.sim.outer
        bottleneck = (f"DiLoCo: inner step {row.sim.inner.iteration_time * 1e3:.1f} ms, each outer exchange "
                      f"{out.exchange_s * 1e3:.1f} ms ({out.exposed_s * 1e3:.1f} ms not hidden), "
                      f"{out.per_step_s / row.iteration_s:.1%} of a step amortized")
    return replace(res, plan=row.plan, sim=row.sim, estimate_s=row.iteration_s, lower_bound_s=math.nan,
                   lower_bound_parts={}, bottleneck=bottleneck, explanation=lines, modes=rows)


def format_modes(spec, rows: list[ModeRow], chosen: Plan | None = None) -> list[str]:
    """The side-by-side table of `plan --compare` (per iteration: one step of every worker)."""
    seq = spec.model.seq_len
    head = (f"  {'mode':<34} {'iteration':>10} {'tokens/s':>12} {'WAN B/token':>11} {'$/1M tok':>9}  "
            f"{'loss cost':<10} notes")
    out = ["", "cross-DC modes (simulated; sync-dp and hier-dp analytical; loss cost: relative final eval loss "
               "over synchronous training's):", head]
    for r in sorted(rows, key=lambda r: -r.tokens_per_s if r.ok else math.inf):
        mark = "*" if chosen is not None and r.plan is chosen else " "
        if not r.ok:
            out.append(f" {mark}{r.label:<34} {'n/a':>10}  {r.note}")
            continue
        tokens = (r.plan.global_batch if r.plan is not None else spec.job.global_batch) * seq
        usd = f"{r.usd_per_mtok:.3f}" if r.usd_per_mtok is not None else "-"
        gap = "none" if r.exact else (f"{r.gap:+.2%}" if r.gap is not None else "?")
        note = "; ".join(x for x in (r.loss_note if not r.exact else "", r.note) if x)
        t = f"{r.iteration_s * 1e3:.1f} ms" if r.iteration_s < 10 else f"{r.iteration_s:.2f} s"
        out.append(f" {mark}{r.label:<34} {t:>10} {r.tokens_per_s:>12,.0f} {r.wan_bytes / tokens:>11,.0f} "
                   f"{usd:>9}  {gap:<10} {note}")
    return out
