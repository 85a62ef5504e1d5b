"""Baselines the planner is compared with, each a plan generator run through the same simulator.

* naive-pp      -- pipeline across the DCs in input order (stages proportional to GPU counts,
                   doubled until the model fits), even layer split, plain 1F1B, one TCP connection
                   per transfer, fair link sharing.
* varuna        -- PP + DP chosen without WAN awareness (Varuna-like): the layout search with the
                   WAN treated as free, DCs in input order, balanced split, 1F1B, one connection,
                   fair sharing.
* single-dc     -- the largest DC alone, with the best plan this planner finds inside it.
* dp-across-dcs -- pure data parallelism over every GPU of every DC. Not expressible as a `Plan`
                   (a plan never lets DP cross the WAN), so `dp_across_dcs` computes it
                   analytically -- see its docstring for the assumptions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from geotrain.costs import comm
from geotrain.errors import GeotrainError
from geotrain.layout.plan import LinkPlan, Plan, StagePlan
from geotrain.planner.analytic import held
from geotrain.planner.chains import enumerate_layouts
from geotrain.planner.context import PlanningContext
from geotrain.planner.placement import divisors
from geotrain.planner.scan import search
from geotrain.planner.scorer import Scorer
from geotrain.planner.split import split_even
from geotrain.spec.load import Spec

BASELINES = ("dp-across-dcs", "naive-pp", "varuna", "single-dc")


@dataclass
class BaselineResult:
    name: str
    plan: Plan | None
    iteration_s: float = math.inf       # inf: not applicable / does not fit
    tokens_per_s: float = 0.0
    utilization: float = 0.0
    wan_bytes: float = 0.0
    gpus_per_dc: dict[str, int] = field(default_factory=dict)
    note: str = ""
    sim: object | None = None
    egress_usd: float = 0.0            # $ of WAN egress per iteration (plans: layout.price computes it)
    sync_s: float = 0.0                # dp-across-dcs: its DP sync per iteration (costs.comm.cross_dc_sync_time)
    collectives: list = field(default_factory=list)   # dp-across-dcs: the sync's (kind, bytes per GPU)
    replicas: list = field(default_factory=list)      # dp-across-dcs: (DC name, replicas there)

    @property
    def ok(self) -> bool:
        return math.isfinite(self.iteration_s)


def _mb(spec: Spec) -> int:
    return spec.job.micro_batch if isinstance(spec.job.micro_batch, int) else 1


def _cheapest_fit(ctx: PlanningContext, plan: Plan) -> Plan | None:
    """The plan with the cheapest checkpointing/sharding the job allows under which every stage
    fits its GPUs (1F1B in-flight counts), or None."""
    for ckpt in ctx.checkpointing_options():
        for sharding in ctx.sharding_options():
            if all(ctx.stage_fits(st.chunks, st.dc, plan.micro_batch,
                                  held(plan.schedule, plan.pp, plan.num_microbatches, s, plan.extra_warmup,
                                       plan.virtual_per_stage),
                                  sharding, plan.dp, ckpt)
                   for s, st in enumerate(plan.stages)):
                return plan.with_(checkpointing=ckpt, sharding=sharding)
    return None


def assign_stages_to_dcs(gpus: list[int], pp: int) -> list[int]:
    """naive-pp's placement: index of the DC of each stage, DCs in input order, stage counts
    proportional to GPU counts, every DC at least one stage while stages remain."""
    n = len(gpus)
    if pp < n:
        counts = [1] * pp + [0] * (n - pp)
    else:
        total = sum(gpus)
        counts = [max(1, round(pp * g / total)) for g in gpus]
        while sum(counts) > pp:
            counts[max(range(n), key=lambda i: counts[i])] -= 1
        while sum(counts) < pp:
            counts[max(range(n), key=lambda i: gpus[i] / counts[i])] += 1
    return [i for i, c in enumerate(counts) for _ in range(c)]


def _linked_in_order(ctx: PlanningContext, names: list[str]) -> bool:
    return all(ctx.link(a, b) is not None for a, b in zip(names, names[1:]))


def naive_pp(spec: Spec, ctx: PlanningContext) -> tuple[Plan | None, str]:
    dcs = spec.cluster.datacenters
    names = [d.name for d in dcs]
    if not _linked_in_order(ctx, names):
        return None, "DCs in input order are not linked consecutively"
    gpus = [d.gpus for d in dcs]
    mb = _mb(spec)
    gb = spec.job.global_batch
    pp = len(dcs)
    while pp <= min(ctx.num_units, sum(gpus) // ctx.tp):
        stage_dc = assign_stages_to_dcs(gpus, pp)
        per = {i: stage_dc.count(i) for i in set(stage_dc)}
        dp_max = min(gpus[i] // (c * ctx.tp) for i, c in per.items())
        dps = [d for d in divisors(gb // mb) if d <= dp_max and gb // (d * mb) >= pp]
        if dps and len(per) == len(dcs):
            dp = dps[-1]
            ranges = split_even(ctx.num_units, pp)
            stages = tuple(StagePlan(dc=names[stage_dc[s]], chunks=(ranges[s],)) for s in range(pp))
            links = tuple(LinkPlan(src_dc=a, dst_dc=b, connections=1, sharing="fair") for a, b in zip(names, names[1:]))
            plan = Plan(stages=stages, dp=dp, micro_batch=mb, num_microbatches=gb // (dp * mb), schedule="1f1b",
                        tp=ctx.tp, precision=spec.job.precision, links=links, name="naive-pp")
            fit = _cheapest_fit(ctx, plan)
            if fit is not None:
                return fit, ""
        pp *= 2
    return None, "does not fit in memory at any pipeline depth"


def varuna(spec: Spec, ctx: PlanningContext) -> tuple[Plan | None, str]:
    names = tuple(d.name for d in spec.cluster.datacenters)
    if not _linked_in_order(ctx, list(names)):
        return None, "DCs in input order are not linked consecutively"
    scorer = Scorer(ctx, wan_aware=False, fixed_connections=1, sharing=("fair",), kinds=("1f1b",))
    layouts = [lay for lay in enumerate_layouts(ctx, [names], wan_aware=False)]
    best = search(ctx, scorer, layouts, keep=1)
    if not best:
        return None, "does not fit"
    best[0].name = "varuna"
    return best[0].to_plan(ctx), ""


def single_dc(spec: Spec, ctx: PlanningContext) -> tuple[Plan | None, str]:
    big = max(spec.cluster.datacenters, key=lambda d: d.gpus)
    scorer = Scorer(ctx)
    best = search(ctx, scorer, enumerate_layouts(ctx, [(big.name,)]), keep=1)
    if not best:
        job = spec.job
        need = (job.pp or 1) * (job.dp or 1) * ctx.tp
        if need > big.gpus:  # not a memory problem: the job's pinned layout needs more GPUs than the DC has
            pins = " x ".join(f"{k}={v}" for k, v in (("pp", job.pp), ("dp", job.dp), ("tp", ctx.tp)) if v and v > 1)
            return None, f"the job pins {pins} = {need} GPUs; {big.name}, the largest DC, has {big.gpus}"
        return None, f"does not fit in {big.name} alone"
    best[0].name = "single-dc"
    return best[0].to_plan(ctx), ""


def pipeline_baselines(spec: Spec, ctx: PlanningContext | None = None) -> dict[str, Plan | None]:
    ctx = ctx or PlanningContext(spec)
    return {"naive-pp": naive_pp(spec, ctx)[0], "varuna": varuna(spec, ctx)[0], "single-dc": single_dc(spec, ctx)[0]}


def dp_across_dcs(spec: Spec, ctx: PlanningContext | None = None) -> BaselineResult:
    """Pure DP over all GPUs of all DCs, gradient all-reduce over the WAN, computed analytically
    (the simulator's all-reduce is intra-DC only).

    Assumptions: dp = the largest divisor of global_batch / micro_batch that fits the GPUs,
    replicas spread over DCs in proportion to their size; every GPU runs forward + backward of
    all its micro-batches (time of the slowest GPU type); then the DP sync with no overlap with
    compute, the one a region plan of these replicas runs and the simulator prices
    (costs.comm.cross_dc_sync_time on costs.comm.sync_collectives: per reduce-scatter or
    all-gather a half inside each DC, then a ring of the shards across the k DCs through the
    slowest WAN link among them, each shard owner on its own connection, k-1 latencies); then
    the optimizer step. The sharding (the memory fit per DC, as HSDP) is the cheapest that fits."""
    ctx = ctx or PlanningContext(spec)
    cluster, job = spec.cluster, spec.job
    if job.pp is not None and job.pp > 1:
        return BaselineResult("dp-across-dcs", None, note=f"not applicable: the job pins pp={job.pp}")
    mb = _mb(spec)
    gb = job.global_batch
    tp = ctx.tp
    total = sum(d.gpus // tp for d in cluster.datacenters)
    dp = max(d for d in divisors(gb // mb) if d <= total)
    # Replicas per DC proportional to size (largest remainders).
    shares = [d.gpus // tp * dp / total for d in cluster.datacenters]
    reps = [int(s) for s in shares]
    for i in sorted(range(len(reps)), key=lambda i: reps[i] - shares[i])[: dp - sum(reps)]:
        reps[i] += 1
    used = [(d, r) for d, r in zip(cluster.datacenters, reps, strict=True) if r > 0]
    res = BaselineResult("dp-across-dcs", None, gpus_per_dc={d.name: r * tp for d, r in used})
    k = len(used)
    if k > 1 and not any(ctx.link(a.name, b.name) for a, _ in used for b, _ in used if a.name != b.name):
        res.note = "no WAN link between the DCs"
        return res
    m = gb // (dp * mb)
    units = range(ctx.num_units)
    chunks = ((0, ctx.num_units),)
    for ckpt in ctx.checkpointing_options():
        for sharding in ctx.sharding_options():
            if all(ctx.stage_fits(chunks, d.name, mb, 1, sharding, r, ckpt) for d, r in used):
                break
        else:
            continue
        break
    else:
        need = max(ctx.stage_memory_fraction(chunks, d.name, mb, 1, ctx.sharding_options()[-1], r,
                                             ctx.checkpointing_options()[-1]) * ctx.gpu(d.name).memory_gib
                   for d, r in used)
        res.note = f"does not fit: a whole-model replica needs {need:.0f} GiB per GPU"
        return res
    cm = ctx.cost(ckpt)
    compute = max(m * (t.forward + t.backward) for t in
                  (cm.stage_times(units, ctx.gpu(d.name), mb, tp) for d, _ in used))
    # The sync a region plan of these replicas runs (costs.comm.sync_collectives: the sharding's
    # collectives, zero3's m+1 gathers too), priced as the simulator and the planner price one
    # (comm.cross_dc_sync_time over the DCs' links) and counted as layout.wan_bytes counts it.
    links = [ctx.link(a.name, b.name) for a, _ in used for b, _ in used if a.name < b.name]
    links = [link for link in links if link is not None]
    res.collectives = cm.sync_collectives([units], sharding, m, tp)
    res.replicas = [(d.name, r) for d, r in used]
    sync = comm.cross_dc_sync_time(res.collectives, used, links, tp)
    wan_bytes = 0.0
    if k > 1:
        hop = (k - 1) / k * sum(nbytes for _, nbytes in cm.sync_collectives([units], sharding, m))   # all tp slices
        ring = [d.name for d, _ in used]   # each hop of the ring carries (k-1)/k of every collective
        for a, b in zip(ring, ring[1:] + ring[:1]):
            wan_bytes += hop
            link = ctx.link(a, b)
            if link is not None and link.egress_usd_per_gb:
                res.egress_usd += hop / 1e9 * link.egress_usd_per_gb
    opt = max(cm.optimizer_time(units, ctx.gpu(d.name), sharding, r, tp) for d, r in used)
    t = compute + sync + opt
    res.iteration_s = t
    res.tokens_per_s = gb * spec.model.seq_len / t
    res.utilization = compute / t
    res.wan_bytes = wan_bytes
    res.sync_s = sync
    res.note = f"analytical; {ckpt} checkpointing, {sharding}; DP sync {sync:.2f} s"
    return res


def evaluate_baselines(spec: Spec, ctx: PlanningContext | None = None) -> list[BaselineResult]:
    """Every baseline, as a plan where it is one (geotrain.planner.confirm simulates those)."""
    ctx = ctx or PlanningContext(spec)
    out = [dp_across_dcs(spec, ctx)]
    for name, fn in (("naive-pp", naive_pp), ("varuna", varuna), ("single-dc", single_dc)):
        try:
            plan, why = fn(spec, ctx)
        except GeotrainError as e:
            plan, why = None, str(e)
        r = BaselineResult(name, plan, note=why)
        if plan is not None:
            r.gpus_per_dc = plan.gpus_per_dc()
        out.append(r)
    return out
