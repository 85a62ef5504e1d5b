"""Re-simulate a plan for a report: the same layout under every schedule kind.

Asks the simulator, never a formula: each kind in `geotrain.schedule.builders.BUILDERS` is
simulated on the same layout (re-targeted by `planner.variants.schedule_variant`). A kind whose
builder (or the layout) rejects the shape is listed with the reason rather than silently dropped.
"""

from __future__ import annotations

from typing import Any

from geotrain.console import progress as bar
from geotrain.errors import GeotrainError
from geotrain.layout.plan import Plan
from geotrain.planner.variants import schedule_variant
from geotrain.report.compare import ScheduleRow, row_from_metrics
from geotrain.schedule.builders import BUILDERS
from geotrain.sim import simulate
from geotrain.trace.metrics import Metrics


def compare_schedules(spec: Any, plan: Plan, iterations: int = 1, known: dict[str, Metrics] | None = None,
                      progress: bool | None = None, cost: Any = None) -> list[ScheduleRow]:
    """Simulate `plan` under every registered schedule kind. `known` holds metrics already
    computed (the main run's), which are reused instead of simulated again; `cost`: the cost model
    to simulate with (a measured profile's), default the spec's."""
    known = known or {}
    rows: list[ScheduleRow] = []
    kinds = list(BUILDERS)
    for kind in bar(kinds, total=len(kinds), desc="schedules", enable=progress):
        if kind in known and kind == plan.schedule:
            rows.append(row_from_metrics(kind, known[kind], "the plan's schedule"))
            continue
        try:
            variant, note = schedule_variant(plan, kind, spec.model.num_units, spec)
            res = simulate(spec, variant, iterations=iterations, cost=cost)
        except (ValueError, GeotrainError) as e:
            rows.append(ScheduleRow(kind, None, None, None, None, None, f"not applicable: {e}"))
            continue
        rows.append(row_from_metrics(kind, res.metrics, note))
    return rows
