"""Layouts: where the GPUs of a pipeline come from, and the list the search scans.

A layout is a chain of linked DCs, stages per DC, dp and micro-batching. `enumerate_layouts`
lists every layout the job allows -- DC chains (simple paths of the WAN graph) x dp (divisors of
the batch) x pp (every small value, then a x1.25 ladder) x micro-batch -- each with a cheap lower
bound on its iteration time (ideal compute of its GPUs, WAN bytes over capacity, WAN latency), so
the search can scan them in bound order and stop early. Stage counts per DC go fastest GPUs
first; chains over alike DCs (same hardware, prices and links) give their layouts once.
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.planner.context import GBIT, PlanningContext
from geotrain.planner.placement import chains, distribute_ranked, iter_dp, pp_candidates, speed_ranks, stage_dcs
from geotrain.schedule.builders import BUILDERS
from geotrain.spec.job import MAX_MICROBATCHES

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
    span: tuple[str, ...] = ()        # region layout: the DCs the DP pipelines spread over (chain = (span[0],))
    replicas: tuple[int, ...] = ()    # ... and the pipelines in each

    @property
    def pp(self) -> int:
        return sum(self.counts)

    @property
    def stage_dcs(self) -> list[str]:
        return stage_dcs(self.chain, self.counts)


def schedule_kinds(ctx: PlanningContext, chain_len: int) -> tuple[str, ...]:
    if ctx.job.schedule != "auto":
        return (ctx.job.schedule,)
    kinds = ["1f1b", "zb-h1"]
    if chain_len > 1:
        kinds.append("wan-1f1b")
    else:
        kinds.append("interleaved")  # its chunk order wraps last->first stage: only inside one DC
    return tuple(k for k in kinds if k in BUILDERS)


def chain_signature(ctx: PlanningContext, chain: tuple[str, ...]) -> tuple:
    """What the simulator sees of a chain: per DC its hardware, per hop the link's numbers -- two
    chains over alike DCs (two equal zones swapped) give the same layouts. Prices are part of it,
    so alike DCs at different prices stay apart, and so is each DC's tensor-parallel degree."""
    def dc(name: str) -> tuple:
        d = ctx.dc(name)
        return (d.gpu_type, d.gpus_per_node, d.intra_node_gbps, d.intra_dc_gbps, d.intra_dc_latency_us,
                d.price_per_gpu_hour, ctx.tp_of(name))

    hops = tuple((lk.latency_ms, lk.capacity_gbps, lk.per_connection_gbps, lk.max_connections, lk.loss, lk.jitter_ms,
                  lk.egress_usd_per_gb)
                 for lk in (ctx.link(a, b) for a, b in zip(chain, chain[1:])))
    return tuple(dc(x) for x in chain), hops


def enumerate_layouts(ctx: PlanningContext, allowed_chains: list[tuple[str, ...]] | None = None,
                      wan_aware: bool = True) -> list[Layout]:
    """Every (chain, dp, pp, micro-batch) the job allows, each with a lower bound on its time."""
    job, cluster = ctx.job, ctx.cluster
    gb = job.global_batch
    mbs = [job.micro_batch] if isinstance(job.micro_batch, int) else [b for b in MICRO_BATCHES if gb % b == 0]
    out = []
    seen: set[tuple] = set()   # (what the chain looks like, counts, dp, mb): alike DCs swapped are one layout
    looks: dict[tuple, int] = {}
    for chain in allowed_chains or chains(cluster):
        if not all(ctx.tp_fits(d) for d in chain):
            continue   # a TP group would straddle two nodes of some DC of the chain
        if not ctx.owns(chain):
            continue   # listed by the context where the kinds of DC it lacks run their smallest tp
        tps = [ctx.tp_of(d) for d in chain]
        # tensors' worth of bytes per boundary: one between equal tps (scattered), else one per receiving TP rank
        copies = [1 if a == b else max(a, b) for a, b in zip(tps, tps[1:])]
        look = looks.setdefault(chain_signature(ctx, chain), len(looks))   # an int hashes fast
        gpus = [cluster.dc(d).gpus for d in chain]
        groups = [g // t for g, t in zip(gpus, tps, strict=True)]   # TP groups each DC holds
        types = [cluster.dc(d).gpu_type for d in chain]
        mems = [cluster.gpu(t).memory_gib for t in types]
        if job.pp is not None and job.pp < len(chain):
            continue
        kinds = schedule_kinds(ctx, len(chain))
        for mb in mbs:
            # Ideal per-micro-batch work of the whole model on each DC's GPU type, and the least
            # fill/drain any allowed schedule can have (both split-independent sums over units).
            tabs = [ctx.dc_table(d, mb, ctx.checkpointing_options()[0]) for d in chain]
            work = [tab.step[-1] for tab in tabs]
            speeds = [1.0 / w for w in work]
            ranks = speed_ranks(speeds, mems)
            uniform = min(speeds) == max(speeds)
            fill = min((_fill(kind, tabs, work) for kind in kinds), default=0.0)
            nbytes = ctx.boundary_bytes(mb)
            caps_bw = [ctx.link(a, b).capacity_gbps * GBIT / c for (a, b), c in zip(zip(chain, chain[1:]), copies)]
            lat = sum(ctx.link(a, b).latency_ms * 1e-3 for a, b in zip(chain, chain[1:]))
            for dp in iter_dp(gb, mb, min(groups)):
                if job.dp is not None and dp != job.dp:
                    continue
                caps = tuple(n // dp for n in groups)   # = g // (dp * tp)
                m = gb // (dp * mb)
                if m > MAX_MICROBATCHES:        # more than a schedule holds (spec.job)
                    continue
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
                    period = work[0] / pp if uniform else 1.0 / sum(c * sp for c, sp in zip(counts, speeds))
                    if period < wan_period:
                        period = wan_period
                    out.append(Layout(chain, counts, dp, mb, m, (m - 1) * period + fill + extra))
    return out


def layout_bound(ctx: PlanningContext, lay: Layout, ckpt: str, wan_aware: bool = True) -> float:
    """The lower bound of enumerate_layouts for one layout, with `ckpt`'s unit times."""
    chain, mb = lay.chain, lay.micro_batch
    tabs = [ctx.dc_table(d, mb, ckpt) for d in chain]
    work = [t.step[-1] for t in tabs]
    fill = min(_fill(kind, tabs, work) for kind in schedule_kinds(ctx, len(chain)))
    period = 1.0 / sum(c / w for c, w in zip(lay.counts, work, strict=True))
    extra = 0.0
    if wan_aware and len(chain) > 1:
        caps_bw = [ctx.link(a, b).capacity_gbps * GBIT / ctx.wan_copies(a, b) for a, b in zip(chain, chain[1:])]
        period = max(period, lay.dp * ctx.boundary_bytes(mb) / min(caps_bw))
        extra = 2 * sum(ctx.link(a, b).latency_ms * 1e-3 for a, b in zip(chain, chain[1:]))
    return (lay.m - 1) * period + fill + extra


def _fill(kind: str, tabs, work: list[float]) -> float:
    if kind == "zb-h1":
        return min(t.forward[-1] + t.backward_input[-1] - t.backward_weight[-1] for t in tabs)
    if kind == "interleaved":
        return min(work) / 2
    return min(work)
