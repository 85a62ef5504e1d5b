"""geotrain report RUN_DIR: rebuild a run directory's timeline and HTML page from its files."""

from __future__ import annotations

import argparse

from geotrain.console import format_table, human_bytes, human_rate, human_seconds
from geotrain.report.prefill import bubbletea_rows

DESCRIPTION = (
    "Rebuild DIR/timeline.png and DIR/report.html from DIR/trace.jsonl (or predicted_trace.jsonl), "
    "plus plan.json and metrics.json when present. If DIR also holds measured_trace.jsonl (written by "
    "the runtime), both timelines are drawn stacked and the page opens with a table of iteration time, "
    "utilization and bubble time, predicted vs measured, with their relative error."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="directory written by `geotrain simulate` or `geotrain train`")


def run(args: argparse.Namespace) -> int:
    # lazy: matplotlib, numpy, pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.report.build import metrics_label, prediction_note, rebuild
    from geotrain.report.compare import format_rel, format_value, steady_state

    files, m, measured, main = rebuild(args.run_dir, with_trace=True)
    print(format_table(["metric", metrics_label(main)], [
        ["iteration time", human_seconds(m.iteration_time)],
        ["tokens/s", human_rate(m.tokens_per_s, "tok/s") if m.tokens_per_s not in (0, float("inf")) else "-"],
        ["mean utilization", f"{100 * m.mean_utilization:.1f}%"],
        ["bubble fraction", f"{100 * m.bubble_fraction:.1f}%"],
        ["WAN bytes / iteration", human_bytes(m.wan_bytes)],
    ]))
    if files.comparison:
        print()
        print(format_table(["metric", metrics_label(main), "measured", "rel. error", "why (over 10%)"], [
            [r.metric, format_value(r.predicted, r.unit), format_value(r.measured, r.unit), format_rel(r.rel_error),
             r.note] for r in files.comparison]))
    if files.comparison and measured is not None:
        its = sorted({e.iteration for e in measured.events})
        kept = sorted({e.iteration for e in steady_state(measured).events})
        if kept and len(kept) < len(its):
            print(f"measured: iterations {kept[0]}-{kept[-1]} of {its[0]}-{its[-1]} (the first {len(its) - len(kept)} "
                  "pay connection set-up and first-step allocation; the simulator predicts steady state)")
    print(prediction_note(main))
    bt = bubbletea_rows(args.run_dir)
    if bt:
        print()
        print(format_table(["BubbleTea (measured)", "value"], [list(r) for r in bt]))
    print()
    print("wrote:")
    print(f"  {files.timeline}")
    print(f"  {files.html}")
    if measured is not None:
        print(f"  {files.html.parent / 'measured_trace.chrome.json'} (open in ui.perfetto.dev)")
    return 0
