"""`geotrain report`: rebuild a run directory's timeline and HTML page, and print its tables."""

from __future__ import annotations

from pathlib import Path

from geotrain.console import format_table, human_bytes, human_rate, human_seconds
from geotrain.report.build import metrics_label, prediction_note, rebuild
from geotrain.report.compare import format_rel, format_value, steady_state
from geotrain.report.prefill import bubbletea_rows


def report_run(run_dir: str | Path, say=print) -> None:
    """Rebuild RUN_DIR's report (`build.rebuild`); say its metrics, predicted against measured where
    the run was measured, BubbleTea's numbers, and the files written."""
    files, m, measured, main = rebuild(run_dir, with_trace=True)
    say(format_table(["metric", metrics_label(main)], [
        ["iteration time", human_seconds(m.iteration_time)],
        ["tokens/s", human_rate(m.tokens_per_s, "tok/s") if m.tokens_per_s not in (0, float("inf")) else "-"],
        ["mean utilization", f"{100 * m.mean_utilization:.1f}%"],
        ["bubble fraction", f"{100 * m.bubble_fraction:.1f}%"],
        ["WAN bytes / iteration", human_bytes(m.wan_bytes)],
    ]))
    if files.comparison:
        say("")
        say(format_table(["metric", metrics_label(main), "measured", "rel. error", "why (over 10%)"], [
            [r.metric, format_value(r.predicted, r.unit), format_value(r.measured, r.unit), format_rel(r.rel_error),
             r.note] for r in files.comparison]))
    if files.comparison and measured is not None:
        its = sorted({e.iteration for e in measured.events})
        kept = sorted({e.iteration for e in steady_state(measured).events})
        if kept and len(kept) < len(its):
            say(f"measured: iterations {kept[0]}-{kept[-1]} of {its[0]}-{its[-1]} (the first {len(its) - len(kept)} "
                "pay connection set-up and first-step allocation; the simulator predicts steady state)")
    say(prediction_note(main))
    bt = bubbletea_rows(run_dir)
    if bt:
        say("")
        say(format_table(["BubbleTea (measured)", "value"], [list(r) for r in bt]))
    say("")
    say("wrote:")
    say(f"  {files.timeline}")
    say(f"  {files.html}")
    if measured is not None:
        say(f"  {files.html.parent / 'measured_trace.chrome.json'} (open in ui.perfetto.dev)")
