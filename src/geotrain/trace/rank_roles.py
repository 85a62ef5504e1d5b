"""Who each rank is (stage, replica, DC) for labelling timelines and Chrome tracks.

The trace itself only knows rank numbers; the plan says where each rank sits. A trace may carry
its plan in `trace.meta["plan"]` (a `Plan.to_dict()`), which lets a report label a measured
trace without the spec. Without any plan, the stage is inferred from the events and the DC is
unknown.
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.layout.plan import Plan
from geotrain.trace.metrics import trace_columns
from geotrain.trace.schema import COMPUTE_KINDS, Trace


@dataclass(frozen=True)
class RankInfo:
    rank: int
    stage: int        # physical stage, -1 when unknown
    replica: int      # DP replica, -1 when unknown
    dc: str           # datacenter name, "?" when unknown

    @property
    def label(self) -> str:
        parts = [f"r{self.rank}"]
        if self.stage >= 0:
            parts.append(f"s{self.stage}")
        if self.replica >= 0:
            parts.append(f"dp{self.replica}")
        return " ".join(parts)


def plan_of(trace: Trace, plan: Plan | None = None) -> Plan | None:
    """The plan given, else the one stored in the trace's meta, else None."""
    if plan is not None:
        return plan
    d = trace.meta.get("plan") if isinstance(trace.meta, dict) else None
    if isinstance(d, dict):
        try:
            return Plan.from_dict(d)
        except (KeyError, TypeError, ValueError):
            return None
    return None


def num_ranks(trace: Trace, plan: Plan | None = None) -> int:
    n = trace.num_ranks
    if plan is not None:
        n = max(n, plan.num_ranks)
    cols = trace_columns(trace)
    if len(cols):
        n = max(n, 1 + int(cols.rank.max()))
    return n


def rank_layout(trace: Trace, plan: Plan | None = None) -> list[RankInfo]:
    """One RankInfo per rank, in rank order (stage-major, so a DC's ranks are contiguous)."""
    plan = plan_of(trace, plan)
    n = num_ranks(trace, plan)
    if plan is not None:
        out = []
        for r in range(n):
            if r < plan.num_ranks:
                s, rep, _ = plan.coords(r)
                out.append(RankInfo(r, s, rep, plan.dc_of(s, rep)))
            else:
                out.append(RankInfo(r, -1, -1, "?"))
        return out
    stage: dict[int, int] = {}
    pp = trace.meta.get("pp") if isinstance(trace.meta, dict) else None
    cols = trace_columns(trace)
    m = cols.kind_mask(COMPUTE_KINDS) & (cols.stage >= 0)
    for r, v in zip(cols.rank[m].tolist(), cols.stage[m].tolist()):
        s = v % pp if isinstance(pp, int) and pp > 0 else v
        stage[r] = min(stage.get(r, s), s)
    rank_dc = trace.meta.get("rank_dc", {}) if isinstance(trace.meta, dict) else {}
    return [RankInfo(r, stage.get(r, -1), -1, str(rank_dc.get(str(r), rank_dc.get(r, "?")))) for r in range(n)]


def dc_order(layout: list[RankInfo]) -> list[str]:
    """DC names in order of first appearance by rank."""
    seen: list[str] = []
    for info in layout:
        if info.dc not in seen:
            seen.append(info.dc)
    return seen
