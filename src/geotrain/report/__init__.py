"""Reports of a simulated or measured run: timeline pictures, an HTML page, comparisons.

    draw_timeline(trace, path, plan=None)              one trace, a row per GPU
    draw_timelines([(name, trace), ...], path, plan)   stacked (predicted over measured)
    compare_traces(predicted, measured) -> [CompareRow]
    build_report(dir, trace, metrics, ...)             timeline.png + report.html
    rebuild(run_dir)                                   `geotrain report`
    draw_curves(run_dir)                               curves.png from losses.jsonl
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy: importing one part of the report (say its comparisons) must not pull in matplotlib.
_EXPORTS = {
    "ReportFiles": "build", "build_report": "build", "rebuild": "build",
    "CompareRow": "compare", "ScheduleRow": "compare", "compare_traces": "compare",
    "draw_timeline": "timeline", "draw_timelines": "timeline", "draw_curves": "curves",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"geotrain.report.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'geotrain.report' has no attribute {name!r}")
