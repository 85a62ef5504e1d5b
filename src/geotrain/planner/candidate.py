"""A scored candidate: a layout with its schedule kind, memory techniques, WAN use and estimate,
and the plan it becomes (scorer.py makes them; search, baselines and the exhaustive checker turn
them into plans). Each stage's tp is the one its DC was scored at (`tps`)."""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.layout.plan import LinkPlan, Plan, StagePlan
from geotrain.planner.analytic import Estimate
from geotrain.planner.chains import Layout
from geotrain.planner.context import EP_KEY, PlanningContext
from geotrain.planner.sharing import apply_fair, apply_temporal


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
    tp: int | None = None   # the context's tp when None
    tps: tuple[tuple[str, int], ...] = ()   # the context's per-DC tp (its key, Shortlist.ctx_for)
    stage_checkpointing: tuple[str, ...] = ()   # per stage, where lighter than `checkpointing` fits

    def to_plan(self, ctx: PlanningContext) -> Plan:
        lay = self.layout
        dcs = lay.stage_dcs
        modes = self.stage_checkpointing or (self.checkpointing,) * len(dcs)
        tps = dict(self.tps) if self.tps else ctx.tps     # the tp of each DC, as scored (and EP_KEY: its ep)
        tp = tps[dcs[0]]                                   # the plan's: stage 0's; others where they differ
        stages = tuple(StagePlan(dc=dc, chunks=ch, checkpointing=md if md != self.checkpointing else None,
                                 tp=tps[dc] if tps[dc] != tp else None)
                       for dc, ch, md in zip(dcs, self.chunks, modes, strict=True))
        links = tuple(LinkPlan(src_dc=a, dst_dc=b, connections=n, sharing="fair")
                      for (a, b), n in zip(zip(lay.chain, lay.chain[1:]), self.connections, strict=True))
        ep = dict(self.tps).get(EP_KEY, 1) if self.tps else ctx.ep     # the context's expert parallelism
        plan = Plan(stages=stages, dp=lay.dp, micro_batch=lay.micro_batch, num_microbatches=lay.m, ep=ep,
                    schedule=self.kind, tp=tp, precision=ctx.job.precision,
                    checkpointing=self.checkpointing, sharding=self.sharding, links=links,
                    extra_warmup=self.extra if self.kind == "wan-1f1b" else (), name=self.name,
                    replica_dcs=tuple(d for d, n in zip(lay.span, lay.replicas, strict=True) for _ in range(n)))
        if self.sharing == "temporal":
            return apply_temporal(plan, ctx.cluster, ctx.boundary_bytes(lay.micro_batch), self.est.period)
        return apply_fair(plan)
