"""Scoring a layout: the best schedule kind, memory techniques and WAN sharing for it, by the
analytical estimate (planner/analytic.py).

For a layout: checkpointing (cheapest that fits first; heavier only when nothing fits), schedule
kind, every sharding that fits (ZeRO also shards the optimizer step), temporal vs fair WAN
sharing where they can differ; the layer split is balanced per stage time (split.py), cached per
GPU-type sequence. `plan_score.score_plan` gives the estimate of an existing plan (baselines,
explanations).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from geotrain.costs.activations import SELECTIVE
from geotrain.layout.stage_costs import with_tp_comm
from geotrain.planner.analytic import BoundaryCosts, StageTerms, finish, held, pipe_floor, pipeline_part
from geotrain.planner.candidate import Candidate
from geotrain.planner.chains import Layout, schedule_kinds
from geotrain.planner.context import GBIT, PlanningContext
from geotrain.planner.sharing import offsets_span
from geotrain.planner.split import balanced_split, split_even
from geotrain.planner.stage_checkpointing import stage_modes
from geotrain.planner.warmup import fit_warmup, wanted_warmup
from geotrain.transport.turns import concurrent_turns, turn_slots


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
        self._layout_costs: dict[tuple, list[StageTerms]] = {}   # per layout being scored (_costs)
        self._variant_memo: dict[tuple, list] = {}
        self._split_of: dict[tuple, tuple] = {}
        self._chunks_of: dict[tuple, tuple] = {}
        self.scored = 0
        self.pruned = False   # the last score() skipped a candidate for its cutoff
        self.tightest: tuple[float, str, str] | None = None  # (memory fraction, DC, layout) nearest to fitting

    # -- pieces ------------------------------------------------------------------------------
    def split_of(self, lay: Layout, ckpt: str, v: int):
        """(chunks, compute costs) of a layout's balanced split: memoised on the layout's small
        key -- the scan asks for it from may_fit, the split bound and score, and hashing the
        per-stage DC list and chunks of an 80-stage pipeline each time cost more than the split."""
        key = (lay.chain, lay.counts, lay.micro_batch, ckpt, v)
        hit = self._split_of.get(key)
        if hit is None:
            chunks = self.chunks_of(lay, ckpt, v, key)
            hit = self._split_of[key] = (chunks, self.compute_costs(lay.stage_dcs, chunks, lay.micro_batch, ckpt))
        return hit

    def chunks_of(self, lay: Layout, ckpt: str, v: int, key: tuple | None = None):
        """The chunks of `split_of` alone (memoised): may_fit reads only the first stage's, and
        the layouts it turns away never need the per-stage compute costs."""
        key = key or (lay.chain, lay.counts, lay.micro_batch, ckpt, v)
        hit = self._chunks_of.get(key)
        if hit is None:
            ctx = self.ctx
            per_dc = [(ctx.dc(d).gpu_type, ctx.tp_of(d)) for d in lay.chain]   # per stage: its DC's
            types = tuple(itertools.chain.from_iterable(itertools.repeat(t, c)
                                                        for t, c in zip(per_dc, lay.counts, strict=True)))
            hit = self._chunks_of[key] = self._split_types(types, lay.micro_batch, ckpt, v)
        return hit

    def split(self, dcs: list[str], mb: int, ckpt: str, v: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        ctx = self.ctx
        return self._split_types(tuple((ctx.dc(d).gpu_type, ctx.tp_of(d)) for d in dcs), mb, ckpt, v)

    def _split_types(self, types: tuple, mb: int, ckpt: str, v: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """The balanced split of stages of these (GPU type, tp), cached per sequence."""
        ctx = self.ctx
        key = (types, mb, ckpt, v, self.even_split)
        out = self._splits.get(key)
        if out is None:
            pp = len(types)
            if self.even_split:
                ranges = split_even(ctx.num_units, pp * v)
            else:
                prefixes = [ctx.table(*types[i % pp][:1], mb, ckpt, types[i % pp][1]).step for i in range(pp * v)]
                ranges = balanced_split(prefixes)
            out = tuple(tuple(ranges[c * pp + s] for c in range(v)) for s in range(pp))
            self._splits[key] = out
        return out

    def stage_costs(self, dcs: list[str], chunks, mb: int, ckpt: str | tuple[str, ...], sharding: str, dp: int,
                    lay: Layout) -> list[StageTerms]:
        """Per-stage costs; `ckpt` one mode for every stage or one per stage."""
        ctx = self.ctx
        modes = (ckpt,) * len(dcs) if isinstance(ckpt, str) else ckpt
        per_mode = {md: self.compute_costs(dcs, chunks, mb, md) for md in set(modes)}   # one lookup a mode
        compute = [per_mode[md][s] for s, md in enumerate(modes)]
        return self._with_tied([StageTerms(f, b, bi, bw, self._sync(lay, ch, dp, dc, sharding),
                                           ctx.optimizer(ch, dc, sharding, dp))
                                for (f, b, bi, bw), ch, dc in zip(compute, chunks, dcs, strict=True)],
                               dcs, sharding, dp)

    def _with_tied(self, costs: list[StageTerms], dcs, sharding: str, dp: int) -> list[StageTerms]:
        """The first and last stage's sync plus the tied embedding's gradient sum (as the
        simulator adds it: layout.stage_costs.plan_inputs)."""
        t = self.ctx.tied_sum(tuple(dcs), sharding, dp) if len(costs) > 1 else 0.0
        if t:
            costs[0] = replace(costs[0], allreduce=costs[0].allreduce + t)
            costs[-1] = replace(costs[-1], allreduce=costs[-1].allreduce + t)
        return costs

    def _sync(self, lay: Layout, chunks, dp: int, dc: str, sharding: str) -> float:
        """The stage's DP sync (zero3's gathers: one per micro-batch and one more, lay.m): inside
        its DC, or across the DCs of a region layout."""
        if lay.span:
            return self.ctx.allreduce_span(chunks, lay.span, lay.replicas, sharding, lay.m)
        return self.ctx.allreduce(chunks, dp, dc, sharding, lay.m)

    def connections(self, a: str, b: str, dp: int, sharing: str) -> int:
        """Connections per transfer: a fair link's flows (dp pipelines x the boundary's copies,
        context.copies) share the saturating count; a temporal turn takes it whole."""
        link = self.ctx.link(a, b)
        if self.fixed_connections is not None:
            return self.fixed_connections
        sat = link.connections_to_saturate()
        flows = dp * self.ctx.copies(a, b)
        return sat if sharing == "temporal" or flows <= 1 else max(1, math.ceil(sat / flows))

    def boundaries(self, lay: Layout, sharing: str, conns: tuple[int, ...], v: int,
                   stage_ctxs: list[PlanningContext] | None = None) -> tuple[list[BoundaryCosts], float]:
        """Per physical boundary costs; also the temporal stagger (one micro-batch at full rate).

        A WAN boundary runs `copies` parallel flows per micro-batch and pipeline (one to each
        receiving TP rank, context.copies) of `n` connections each, at up to copies x one flow's
        rate; between stages of equal tp they carry one tensor in all (1/tp slices, then the
        receiver's TP all-gather, context.tp_gather), else a whole copy each -- as the simulator.
        stage_ctxs: per stage the context of its own tp (a plan whose DC holds stages of two tps,
        `plan_score.stage_contexts`); None: every stage at its DC's tp in this scorer's context."""
        ctx = self.ctx
        dcs = lay.stage_dcs
        one = ctx.boundary_bytes(lay.micro_batch)
        dp = lay.dp
        out, stagger, wan_i = [], 0.0, 0
        for s in range(len(dcs) - 1):
            a, b = dcs[s], dcs[s + 1]
            ta, tb = (stage_ctxs[s].tps[a], stage_ctxs[s + 1].tps[b]) if stage_ctxs else (ctx.tps[a], ctx.tps[b])
            scattered = ta == tb > 1
            gather = (stage_ctxs[s + 1] if stage_ctxs else ctx).tp_gather(b, one) if scattered else 0.0
            if a == b:
                share = one // ta if scattered else one
                out.append(BoundaryCosts(False, ctx.intra_dc_transfer(a, share) + gather, 0.0))
                continue
            n = conns[wan_i]
            wan_i += 1
            copies = ta if ta > tb else tb        # context.copies, wan_copies at these two tps
            nbytes = one * (1 if ta == tb else copies)
            w = ctx.costs.wan(a, b, n, sharing, dp, copies)   # as the simulator prices the direction
            lat, flow, cap = w.latency, w.flow_gbps, w.capacity_gbps
            if sharing == "temporal" and dp > 1:
                # Work-conserving turns: a few transfers at once fill the link (concurrent_turns);
                # each turn costs w.turn_s where the runtime takes turns (transport.turns.turn_slots).
                slots = min(dp, concurrent_turns(cap, flow))
                rate = min(flow, cap / slots) * GBIT   # turn_rate_gbps, of copies flows
                delay = lat + nbytes / rate + w.turn_s + gather
                occ = dp * nbytes / (slots * rate)
                stagger = max(stagger, nbytes / rate)
            else:
                agg = min(dp * flow, cap) * GBIT
                delay = lat + nbytes * dp / agg + gather
                occ = dp * nbytes / agg
            if not self.wan_aware:
                delay, occ = 0.0, 0.0
            out.append(BoundaryCosts(True, delay, occ, f"{a}->{b}"))
        return out, stagger

    # -- a layout ------------------------------------------------------------------------------
    def score(self, lay: Layout, kinds: tuple[str, ...] | None = None, skip: int = 0,
              cutoff: float = math.inf) -> Candidate | None:
        """The best (schedule kind, checkpointing, sharding, WAN sharing) for a layout, or None
        if nothing fits. Heavier checkpointing is tried only when no kind fits with a lighter one;
        the `skip` lightest are known not to fit (search's may_fit). Candidates whose estimate
        cannot come under `cutoff` are skipped (so None also means: nothing under the cutoff)."""
        self.pruned = False
        ctx = self.ctx
        pp, m = lay.pp, lay.m
        kinds = kinds or self.kinds or schedule_kinds(ctx, len(lay.chain))
        wan_lat = sum(ctx.link(a, b).latency_ms * 1e-3 for a, b in zip(lay.chain, lay.chain[1:]))
        variants = self.variants(lay)
        best: Candidate | None = None
        self._layout_costs = {}
        kinds = tuple(k for k in kinds if not (k == "interleaved" and (pp < 2 or m % pp or ctx.num_units < pp * 2))
                      and not (k == "wan-1f1b" and len(lay.chain) < 2))
        every = {(kind, sharing) for kind in kinds for sharing, *_ in variants}
        behind: set[tuple[str, str]] = set()   # (kind, sharing) past the cutoff, or nothing of their own
        for ckpt in ctx.checkpointing_options()[skip:]:
            for kind in kinds:
                v = 2 if kind == "interleaved" else 1
                if kind == "zb-h1" and ckpt in SELECTIVE:
                    continue  # the split backward runs twice through a checkpointed region: PyTorch refuses
                if all((kind, sharing) in behind for sharing, *_ in variants):
                    continue
                chunks, compute = self.split_of(lay, ckpt, v)
                for sharing, conns, bounds, stagger in variants:
                    if (kind, sharing) in behind:
                        continue
                    self.pruned = False
                    cand = self._fit_and_estimate(lay, kind, v, ckpt, chunks, compute, bounds, stagger, sharing,
                                                  conns, wan_lat, cutoff)
                    if self.pruned:
                        behind.add((kind, sharing))
                    if cand is not None and (best is None or cand.est.total < best.est.total):
                        best = cand
            # Heavier checkpointing only adds recompute: what is behind the cutoff stays behind, but a
            # kind that did not fit may fit with it (and come under the cutoff).
            if best is not None or every <= behind:
                break
        self.pruned = bool(behind)
        return best

    def variants(self, lay: Layout) -> list[tuple[str, tuple[int, ...], list[BoundaryCosts], float]]:
        """(sharing, connections, boundary costs, temporal stagger) per WAN sharing worth trying
        (memoised: split_bound asks before score does)."""
        key = (lay.chain, lay.counts, lay.dp, lay.micro_batch)
        out = self._variant_memo.get(key)
        if out is not None:
            return out
        out = self._variant_memo[key] = []
        for sharing in self._sharings(lay):
            conns = tuple(self.connections(a, b, lay.dp, sharing) for a, b in zip(lay.chain, lay.chain[1:]))
            bounds, stagger = self.boundaries(lay, sharing, conns, 1)
            out.append((sharing, conns, bounds, stagger))
        return out

    def _sharings(self, lay: Layout) -> tuple[str, ...]:
        """Temporal only where it can differ: some link whose turns hold fewer than dp transfers."""
        ctx, dp = self.ctx, lay.dp
        if len(lay.chain) > 1 and dp > 1 and any(
                turn_slots("temporal", ctx.link(a, b).capacity_gbps, ctx.copies(a, b) * ctx.link(a, b).rate_gbps(
                    self.connections(a, b, dp, "temporal")), dp) for a, b in zip(lay.chain, lay.chain[1:])):
            return self.sharing
        return ("fair",)

    def may_fit(self, lay: Layout, ckpt: str) -> bool:
        """False when the first stage cannot fit with `ckpt` under any allowed kind and sharding
        (a necessary condition only: True does not promise a fit)."""
        kinds = self.kinds or schedule_kinds(self.ctx, len(lay.chain))
        if "interleaved" in kinds:
            return True      # its chunks are split differently; not worth a second check
        if kinds == ("zb-h1",) and ckpt in SELECTIVE:
            return False
        chunks = self.chunks_of(lay, ckpt, 1)
        least = min(held(k, lay.pp, lay.m, 0) for k in kinds)
        return self.ctx.stage_fits(chunks[0], lay.chain[0], lay.micro_batch, least,
                                   self.ctx.sharding_options()[-1], lay.dp, ckpt)

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
            tab = ctx.dc_table(dc, mb, ckpt)
            f = b = bi = bw = 0.0
            for a, e in ch:
                tf, tb, tbi, tbw = tab.times(a, e)
                f, b, bi, bw = f + tf, b + tb, bi + tbi, bw + tbw
            if ctx.tp_of(dc) > 1 or ctx.ep > 1:     # TP all-reduces, EP all-to-alls
                f, b, bi, bw = with_tp_comm(f, b, bi, bw, ctx.tp_comm(ch, mb, dc))
            out.append((f, b, bi, bw))
        return out

    def _costs(self, compute, chunks, dcs, ckpt: str, v: int, sharding: str, dp: int, lay: Layout) -> list[StageTerms]:
        """Per-stage costs of the layout being scored: the same for every schedule kind of one
        chunking and both WAN sharings, so built once per (checkpointing, chunking, sharding)."""
        key = (ckpt, v, sharding)
        hit = self._layout_costs.get(key)
        if hit is None:
            ctx = self.ctx
            hit = self._layout_costs[key] = self._with_tied([
                StageTerms(f, b, bi, bw, self._sync(lay, ch, dp, dc, sharding), ctx.optimizer(ch, dc, sharding, dp))
                for (f, b, bi, bw), ch, dc in zip(compute, chunks, dcs, strict=True)], dcs, sharding, dp)
        return hit

    def _fit_and_estimate(self, lay, kind, v, ckpt, chunks, compute, bounds, stagger, sharing, conns, wan_lat,
                          cutoff: float = math.inf):
        ctx = self.ctx
        dcs = lay.stage_dcs
        pp, m, mb, dp = lay.pp, lay.m, lay.micro_batch, lay.dp
        extra: tuple[int, ...] = ()
        if kind == "wan-1f1b":
            extra = wanted_warmup(compute, bounds, m)
            if not any(extra):
                self.pruned = True   # identical to 1f1b (with heavier checkpointing too: nothing of its own)
                return None
        wanted = extra
        if cutoff < math.inf:
            # The pipeline part bounds every sharding's estimate from below (the tail only adds):
            # a kind already behind the search's keep-th best is not worth its memory checks.
            # stage_modes may lighten a stage below `ckpt` where a lighter mode fits it: priced at
            # `ckpt` throughout the pipeline part is no bound, priced at the lightest mode it is a
            # weak one; between the two, the modes each stage fits decide (memory checks).
            light = self.compute_costs(dcs, chunks, mb, ctx.checkpointing_options()[0])
            if pipe_floor(light, bounds, m, kind, v, extra, cutoff) >= cutoff:
                self.pruned = True
                return None
            if light is not compute and pipe_floor(compute, bounds, m, kind, v, extra, cutoff) >= cutoff and pipe_floor(
                    self._floor_compute(lay, kind, v, ckpt, chunks, compute), bounds, m, kind, v, extra,
                    cutoff) >= cutoff:
                self.pruned = True
                return None
        best: Candidate | None = None
        parts: dict[tuple[int, ...], tuple] = {}   # the sharding only changes the tail: per warm-up, once
        deciding: dict[tuple[int, ...], list] = {}  # per warm-up, the stages whose memory decides
        for sharding in ctx.sharding_options():
            # Every sharding that fits is scored, not only the leanest: sharding the optimizer
            # state also shards the optimizer step, which can make a heavier one faster.
            if kind == "wan-1f1b":
                extra = fit_warmup(ctx, lay, chunks, wanted, sharding, ckpt)
                if not any(extra):
                    continue
            worst = deciding.get(extra)
            if worst is None:
                worst = deciding[extra] = ctx.worst_stages(chunks, dcs, [held(kind, pp, m, s, extra, v)
                                                                         for s in range(pp)])
            if not all(ctx.stage_fits(ch, dc, mb, k, sharding, dp, ckpt) for ch, dc, k in worst):
                continue
            self.scored += 1
            modes = stage_modes(self, lay, kind, v, ckpt, chunks, sharding, extra)
            if modes:
                costs = self.stage_costs(dcs, chunks, mb, modes, sharding, dp, lay)
            else:
                costs = self._costs(compute, chunks, dcs, ckpt, v, sharding, dp, lay)
            hit = parts.get((extra, modes))
            if hit is None:
                part = pipeline_part(costs, bounds, m, kind, v, extra)
                span = offsets_span(dp, stagger, part.period) if sharing == "temporal" else 0.0
                hit = parts[(extra, modes)] = (part, span)
            est = finish(hit[0], costs, bounds, hit[1], wan_lat)
            if best is None or est.total < best.est.total:
                best = Candidate(lay, kind, v, ckpt, sharding, chunks, extra, sharing, conns, est, tp=ctx.tp,
                                 stage_checkpointing=modes, tps=ctx.key)
        if best is not None:
            return best
        if self.scored == 0:
            self._record_miss(lay, kind, v, ckpt, chunks, extra)
        return None

    def _floor_compute(self, lay, kind, v, ckpt, chunks, compute):
        """Per stage, the least compute `stage_modes` can give it: the fastest of `ckpt` and the
        lighter modes that fit the stage under the leanest sharding with the fewest micro-batches
        the kind holds there (no warm-up) -- a lower bound for every sharding and warm-up."""
        ctx = self.ctx
        options = ctx.checkpointing_options()
        lighter = [md for md in options[:options.index(ckpt)] if not (kind == "zb-h1" and md in SELECTIVE)]
        if not lighter:
            return compute
        dcs, mb, lean = lay.stage_dcs, lay.micro_batch, ctx.sharding_options()[-1]
        costs = {md: self.compute_costs(dcs, chunks, mb, md) for md in lighter}
        out = []
        for s, c in enumerate(compute):
            k = held(kind, lay.pp, lay.m, s, (), v)
            fit = [costs[md][s] for md in lighter if ctx.stage_fits(chunks[s], dcs[s], mb, k, lean, lay.dp, md)]
            out.append(min([c, *fit], key=lambda x: x[0] + x[1]))
        return out

    def _record_miss(self, lay, kind, v, ckpt, chunks, extra) -> None:
        ctx = self.ctx
        sharding = ctx.sharding_options()[-1]
        dcs = lay.stage_dcs
        frac, dc = max((ctx.stage_memory_fraction(chunks[s], dcs[s], lay.micro_batch,
                                                  held(kind, lay.pp, lay.m, s, extra, v), sharding, lay.dp, ckpt),
                        dcs[s]) for s in range(lay.pp))
        if self.tightest is None or frac < self.tightest[0]:
            desc = (f"pp={lay.pp}, dp={lay.dp}, micro-batch {lay.micro_batch}, {kind}, "
                    f"checkpointing {ckpt}, sharding {sharding}")
            self.tightest = (frac, dc, desc)
