"""Reports of a simulated or measured run: timeline pictures, an HTML page, comparisons.

    draw_timeline(trace, path, plan=None)              one trace, a row per GPU
    draw_timelines([(name, trace), ...], path, plan)   stacked (predicted over measured)
    compare_traces(predicted, measured) -> [CompareRow]
    compare_schedules(spec, plan) -> [ScheduleRow]     the plan under every schedule kind
    build_report(dir, trace, metrics, ...)             timeline.png + report.html
    rebuild(run_dir)                                   `geotrain report`
"""

from geotrain.report.build import ReportFiles, build_report, rebuild
from geotrain.report.compare import CompareRow, ScheduleRow, compare_schedules, compare_traces
from geotrain.report.timeline import draw_timeline, draw_timelines

__all__ = ["CompareRow", "ReportFiles", "ScheduleRow", "build_report", "compare_schedules", "compare_traces",
           "draw_timeline", "draw_timelines", "rebuild"]
