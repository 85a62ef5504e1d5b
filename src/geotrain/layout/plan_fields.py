"""Field checks of a loaded plan file (layout.plan.load_plan): the first wrong type or impossible
value as (field, reason), so a bad file is one line, not a traceback."""

from __future__ import annotations

import math
from typing import Any

from geotrain.costs.activations import CHECKPOINTING
from geotrain.costs.compression import BOUNDARY_CODECS
from geotrain.layout.workers import outer_problem


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def plan_field_problem(plan) -> tuple[str, str] | None:
    """(field, reason) for the first field of a loaded plan with a wrong type or impossible value."""
    if not plan.stages:
        return "plan.stages", "a plan needs at least one stage"
    for name in ("dp", "micro_batch", "num_microbatches", "tp"):
        if not _is_int(getattr(plan, name)):
            return f"plan.{name}", f"must be an integer (got {getattr(plan, name)!r})"
    for s, st in enumerate(plan.stages):
        if not isinstance(st.dc, str):
            return f"plan.stages[{s}].dc", f"must be a datacenter name (got {st.dc!r})"
        if not st.chunks or any(len(c) != 2 or not all(_is_int(u) for u in c) for c in st.chunks):
            return f"plan.stages[{s}].chunks", f"must be [start, end) pairs of unit indices (got {st.chunks!r})"
        if st.tp is not None and (not _is_int(st.tp) or st.tp < 1):
            return f"plan.stages[{s}].tp", f"must be an integer >= 1 or absent for the plan's tp (got {st.tp!r})"
        if st.checkpointing is not None and st.checkpointing not in CHECKPOINTING:
            return (f"plan.stages[{s}].checkpointing",
                    f"must be one of {', '.join(CHECKPOINTING)} (got {st.checkpointing!r})")
    for i, lp in enumerate(plan.links):
        if not _is_int(lp.connections) or lp.connections < 1:
            return f"plan.links[{i}].connections", f"must be an integer >= 1 (got {lp.connections!r})"
        if not _is_number(lp.stagger_s) or lp.stagger_s < 0:
            return f"plan.links[{i}].stagger_s", f"must be a finite number >= 0 (got {lp.stagger_s!r})"
        if not all(_is_int(x) for x in lp.order):
            return f"plan.links[{i}].order", f"must list DP pipeline indices (got {list(lp.order)!r})"
        if lp.compression not in BOUNDARY_CODECS:
            return (f"plan.links[{i}].compression",
                    f"must be one of {', '.join(BOUNDARY_CODECS)} (got {lp.compression!r})")
        if not _is_int(lp.rank) or lp.rank < 0:
            return f"plan.links[{i}].rank", f"must be an integer >= 0 (got {lp.rank!r})"
    if plan.replica_dcs:
        if len(plan.replica_dcs) != plan.dp or not all(isinstance(x, str) for x in plan.replica_dcs):
            return "plan.replica_dcs", (f"must name the DC of each of the {plan.dp} DP pipelines "
                                        f"(got {list(plan.replica_dcs)!r})")
        if len({st.dc for st in plan.stages}) > 1 or plan.stages[0].dc != plan.replica_dcs[0]:
            return "plan.replica_dcs", ("a region plan keeps each pipeline in one DC: every stage's dc must be "
                                        "replica_dcs[0]")
    if plan.outer is not None:
        problem = outer_problem(plan.outer, plan.pp, plan.replica_dcs)
        if problem:
            return f"plan.outer.{problem[0]}", problem[1]
    if not all(_is_int(x) and x >= 0 for x in plan.extra_warmup):
        return "plan.extra_warmup", f"must be integers >= 0 (got {list(plan.extra_warmup)!r})"
    if not all(_is_number(x) and x >= 0 for x in plan.pipeline_offsets):
        return "plan.pipeline_offsets", f"must be finite seconds >= 0 (got {list(plan.pipeline_offsets)!r})"
    return None
