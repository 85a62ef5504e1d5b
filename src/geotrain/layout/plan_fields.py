"""Field checks of a loaded plan file (layout.plan.load_plan): the first wrong type or impossible
value as (field, reason), so a bad file is one line, not a traceback -- and every count and
duration within what a plan can hold, so nothing downstream allocates, sleeps or spins without end
(100,000 connections, micro_batch 10**6 and offsets of 1e308 s were accepted)."""

from __future__ import annotations

import math
from typing import Any, get_args

from geotrain.costs.activations import CHECKPOINTING
from geotrain.costs.compression import BOUNDARY_CODECS
from geotrain.layout.workers import outer_problem
from geotrain.spec.cluster import PRECISIONS
from geotrain.spec.job import MAX_MICRO_BATCH, MAX_MICROBATCHES, ScheduleKind, Sharding

MAX_DP = 10**7
MAX_TP = 1024
MAX_STAGES = 100_000
MAX_CONNECTIONS = 4096        # the spec's own cap on a link's connections
MAX_OFFSET_S = 3600.0         # a pipeline start offset or stagger: a fraction of an iteration, never hours
SHARING = ("fair", "temporal")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x: Any, hi: int) -> bool:
    return _is_int(x) and 1 <= x <= hi


def plan_field_problem(plan) -> tuple[str, str] | None:
    """(field, reason) for the first field of a loaded plan with a wrong type or impossible value."""
    if not plan.stages or len(plan.stages) > MAX_STAGES:
        return "plan.stages", f"a plan needs 1 to {MAX_STAGES} stages (got {len(plan.stages)})"
    for name, hi in (("dp", MAX_DP), ("micro_batch", MAX_MICRO_BATCH), ("num_microbatches", MAX_MICROBATCHES),
                     ("tp", MAX_TP)):
        if not _count(getattr(plan, name), hi):
            return f"plan.{name}", f"must be an integer from 1 to {hi} (got {getattr(plan, name)!r:.40})"
    if not _count(getattr(plan, "ep", 1), MAX_DP) or plan.dp % plan.ep:
        return "plan.ep", f"must be an integer from 1 to {MAX_DP} dividing dp={plan.dp} (got {plan.ep!r:.40})"
    for name, allowed in (("schedule", get_args(ScheduleKind)), ("precision", PRECISIONS),
                          ("sharding", get_args(Sharding)), ("checkpointing", CHECKPOINTING)):
        if getattr(plan, name) not in allowed:
            return f"plan.{name}", f"must be one of {', '.join(allowed)} (got {getattr(plan, name)!r:.40})"
    if not isinstance(plan.name, str):
        return "plan.name", f"must be a string (got {plan.name!r:.40})"
    for s, st in enumerate(plan.stages):
        if not isinstance(st.dc, str):
            return f"plan.stages[{s}].dc", f"must be a datacenter name (got {st.dc!r:.40})"
        if not st.chunks or any(len(c) != 2 or not all(_is_int(u) and 0 <= u <= 10**6 for u in c)
                                for c in st.chunks):
            return f"plan.stages[{s}].chunks", f"must be [start, end) pairs of unit indices (got {st.chunks!r:.60})"
        if st.tp is not None and not _count(st.tp, MAX_TP):
            return f"plan.stages[{s}].tp", f"must be an integer from 1 to {MAX_TP}, or absent (got {st.tp!r:.40})"
        if st.checkpointing is not None and st.checkpointing not in CHECKPOINTING:
            return (f"plan.stages[{s}].checkpointing",
                    f"must be one of {', '.join(CHECKPOINTING)} (got {st.checkpointing!r:.40})")
    for i, lp in enumerate(plan.links):
        if not isinstance(lp.src_dc, str) or not isinstance(lp.dst_dc, str):
            return f"plan.links[{i}]", "src_dc and dst_dc must be datacenter names"
        if not _count(lp.connections, MAX_CONNECTIONS):
            return f"plan.links[{i}].connections", (f"must be an integer from 1 to {MAX_CONNECTIONS} "
                                                    f"(got {lp.connections!r:.40})")
        if lp.sharing not in SHARING:
            return f"plan.links[{i}].sharing", f"must be one of {', '.join(SHARING)} (got {lp.sharing!r:.40})"
        if not _is_number(lp.stagger_s) or not 0 <= lp.stagger_s <= MAX_OFFSET_S:
            return f"plan.links[{i}].stagger_s", (f"must be seconds from 0 to {MAX_OFFSET_S:g} "
                                                  f"(got {lp.stagger_s!r:.40})")
        if lp.order and sorted(lp.order) != list(range(plan.dp)):
            return f"plan.links[{i}].order", (f"must list each of the {plan.dp} DP pipelines once "
                                              f"(got {list(lp.order)!r:.60})")
        if lp.compression not in BOUNDARY_CODECS:
            return (f"plan.links[{i}].compression",
                    f"must be one of {', '.join(BOUNDARY_CODECS)} (got {lp.compression!r:.40})")
        if not _is_int(lp.rank) or not 0 <= lp.rank <= 2**20:
            return f"plan.links[{i}].rank", f"must be an integer from 0 to {2**20} (got {lp.rank!r:.40})"
    if plan.replica_dcs:
        if len(plan.replica_dcs) != plan.dp or not all(isinstance(x, str) for x in plan.replica_dcs):
            return "plan.replica_dcs", (f"must name the DC of each of the {plan.dp} DP pipelines "
                                        f"(got {list(plan.replica_dcs)!r:.60})")
        if len({st.dc for st in plan.stages}) > 1 or plan.stages[0].dc != plan.replica_dcs[0]:
            return "plan.replica_dcs", ("a region plan keeps each pipeline in one DC: every stage's dc must be "
                                        "replica_dcs[0]")
    if plan.outer is not None:
        problem = outer_problem(plan.outer, plan.pp, plan.replica_dcs)
        if problem:
            return f"plan.outer.{problem[0]}", problem[1]
    if len(plan.extra_warmup) > len(plan.stages) or \
            not all(_is_int(x) and 0 <= x <= MAX_MICROBATCHES for x in plan.extra_warmup):
        return "plan.extra_warmup", (f"must be at most one count from 0 to {MAX_MICROBATCHES} per stage "
                                     f"(got {list(plan.extra_warmup)!r:.60})")
    if len(plan.pipeline_offsets) > plan.dp or \
            not all(_is_number(x) and 0 <= x <= MAX_OFFSET_S for x in plan.pipeline_offsets):
        return "plan.pipeline_offsets", (f"must be at most one offset per DP pipeline, seconds from 0 to "
                                         f"{MAX_OFFSET_S:g} (got {list(plan.pipeline_offsets)!r:.60})")
    return None
