"""geotrain report RUN_DIR: rebuild a run directory's timeline and HTML page from its files."""

from __future__ import annotations

import argparse

from geotrain.report.run_report import report_run

DESCRIPTION = (
    "Rebuild DIR/timeline.png and DIR/report.html from DIR/trace.jsonl (or predicted_trace.jsonl), "
    "plus plan.json and metrics.json when present. If DIR also holds measured_trace.jsonl (written by "
    "the runtime), both timelines are drawn stacked and the page opens with a table of iteration time, "
    "utilization and bubble time, predicted vs measured, with their relative error."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="directory written by `geotrain simulate` or `geotrain train`")


def run(args: argparse.Namespace) -> int:
    report_run(args.run_dir)
    return 0
