"""Assemble a run directory's report: timeline.png + report.html (and, for `simulate`, the
trace files and metrics.json). Both `geotrain simulate` and `geotrain report` end here, so a
page rebuilt later from the files looks exactly like the first one.

Run directory files:
  trace.jsonl (or predicted_trace.jsonl)  the simulated trace
  measured_trace.jsonl                    a runtime trace of the same plan (optional)
  machine_load.json                       other work on the machine while it trained (optional)
  plan.json                               the plan (geotrain.layout.save_plan format; optional)
  metrics.json                            tokens per iteration, peak memory, GPU memory, schedule
                                          comparison -- what a trace alone cannot tell
  losses.jsonl                            a training run's per-step rows (curves.png: loss, lr, grad norm, ...)
  trace.chrome.json, timeline.png, report.html
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from geotrain.errors import GeotrainError
from geotrain.layout.plan import Plan, load_plan
from geotrain.report.compare import CompareRow, ScheduleRow, compare_metrics, explain_rows, steady_state
from geotrain.report.curves import draw_curves, read_rows, summary_line
from geotrain.report.html import write_html
from geotrain.report.prefill import bubbletea_rows
from geotrain.report.timeline import draw_timeline, draw_timelines
from geotrain.trace.chrome import write_chrome
from geotrain.trace.merge import remerge
from geotrain.trace.metrics import LINK_COUNTERS_NAME, MACHINE_LOAD_NAME, Metrics, compute_metrics
from geotrain.trace.rank_roles import num_ranks, plan_of, rank_layout
from geotrain.trace.schema import Trace

PREDICTED_NAMES = ("predicted_trace.jsonl", "trace.jsonl")
MEASURED_NAME = "measured_trace.jsonl"


@dataclass
class ReportFiles:
    timeline: Path | None      # None: not drawn (`timeline=False`)
    html: Path
    comparison: list[CompareRow] = field(default_factory=list)


def _run_memory(d: Path, plan: Plan | None) -> tuple[dict[int, float], dict[int, float]]:
    """(predicted, measured) peak bytes per rank of a training run, from its summary.json: the cost
    model's peak of each rank's stage and the peak the runtime measured on that rank."""
    try:
        summary = json.loads((d / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}, {}
    measured = {r: float(m["peak"]) for r, m in enumerate(summary.get("memory_per_rank") or []) if m.get("peak")}
    stages = {int(m["stage"]): float(m["predicted_peak"]) for m in summary.get("memory_per_stage") or []}
    predicted = {}
    if plan is not None and stages:
        predicted = {r: stages[plan.coords(r)[0]] for r in range(plan.num_ranks) if plan.coords(r)[0] in stages}
    return predicted, measured


def build_report(out_dir: str | Path, trace: Trace, metrics: Metrics, *, plan: Plan | None = None,
                 measured: Trace | None = None, measured_metrics: Metrics | None = None,
                 schedules: list[ScheduleRow] | None = None, gpu_memory: dict[str, float] | None = None,
                 title: str | None = None, notes: list[str] | None = None,
                 tokens_per_iteration: int = 0, bubbletea: list[tuple[str, str]] | None = None,
                 losses_png: Path | None = None, curves_png: Path | None = None,
                 curves_caption: str = "", timeline: bool = True) -> ReportFiles:
    """Draw the timeline and write the HTML page into `out_dir`. With `measured`, both timelines
    are stacked and the page opens with the predicted-vs-measured table. `timeline=False`: the page
    without the picture (drawing it is most of a small plan's simulate)."""
    out = Path(out_dir)
    plan = plan_of(trace, plan)
    layout = rank_layout(trace, plan)
    name = title or (f"geotrain report: {plan.name}" if plan else "geotrain report")
    png = out / "timeline.png" if timeline else None
    link_meta = trace.meta.get("links") if isinstance(trace.meta, dict) else None
    comparison: list[CompareRow] = []
    if measured is not None:
        mm = measured_metrics or _metrics(measured, tokens_per_iteration)
        comparison = explain_rows(compare_metrics(metrics, mm, (num_ranks(trace, plan), num_ranks(measured, plan))),
                                  trace, measured)
        shown, label = last_iterations(measured, _iterations(trace))
        if png is not None:
            draw_timelines([("predicted", trace), (label, shown)], png, plan, title=name)
    elif png is not None:
        draw_timeline(trace, png, plan, title=name)
    html = write_html(out / "report.html", title=name, metrics=metrics, layout=layout, plan=plan,
                      timeline_png=png, schedules=schedules, comparison=comparison or None,
                      gpu_memory=gpu_memory, link_meta=link_meta, notes=(notes or []) + [prediction_note(trace)],
                      metrics_label=metrics_label(trace), bubbletea=bubbletea, losses_png=losses_png,
                      curves_png=curves_png, curves_caption=curves_caption)
    return ReportFiles(png, html, comparison)


def metrics_label(trace: Trace) -> str:
    """Whether a trace's numbers are predicted (and how) or measured."""
    meta = trace.meta if isinstance(trace.meta, dict) else {}
    if trace.source == "measured":
        return "measured"
    return "predicted, calibrated" if meta.get("calibrated") else "predicted, uncalibrated"


def prediction_note(trace: Trace) -> str:
    meta = trace.meta if isinstance(trace.meta, dict) else {}
    label = metrics_label(trace)
    if label == "measured":
        return "All numbers are measured (no prediction in this directory)."
    if meta.get("calibrated"):
        return (f"Predicted numbers come from the simulator calibrated with the profile "
                f"{meta['calibrated'].get('profile', '?')}; measured numbers from the run's own trace.")
    return ("Predicted numbers come from the UNCALIBRATED cost model (datasheet FLOPs and bandwidths): measure "
            "this machine with `geotrain profile SPEC --out profile.json` and train with `--profile profile.json` "
            "for a calibrated prediction. Measured numbers come from the run's own trace.")


def write_measured_chrome(run_dir: str | Path, plan: Plan | None = None) -> Path | None:
    """RUN_DIR/measured_trace.chrome.json (open in ui.perfetto.dev or chrome://tracing)."""
    src = Path(run_dir) / MEASURED_NAME
    if not src.exists():
        return None
    out = Path(run_dir) / "measured_trace.chrome.json"
    write_chrome(read_trace(src), out, plan)
    return out


def _iterations(trace: Trace) -> int:
    its = {e.iteration for e in trace.events}
    return max(1, len(its))


def last_iterations(measured: Trace, k: int) -> tuple[Trace, str]:
    """The measured trace's last `k` iterations, moved to start at 0, and a panel label.

    A run has many more iterations than the prediction (which simulates a few); drawn on one
    time axis the prediction would be a sliver. The last iterations are the steady state --
    the first ones pay for start-up and warm-up."""
    its = sorted({e.iteration for e in measured.events})
    if len(its) <= k:
        return measured, "measured"
    keep = set(its[-k:])
    events = [e for e in measured.events if e.iteration in keep]
    t0 = min(e.start for e in events)

    shifted = [replace(e, start=e.start - t0, end=e.end - t0) for e in events]
    return (Trace(shifted, num_ranks=measured.num_ranks, source=measured.source, meta=measured.meta),
            f"measured (last {k} of {len(its)} iterations)")


def _metrics(trace: Trace, tokens: int, peak: dict[int, float] | None = None, what: str = "trace") -> Metrics:
    try:
        return compute_metrics(trace, tokens, peak)
    except ValueError as e:
        raise GeotrainError(f"{what}: cannot compute metrics ({e})") from None


def read_trace(path: Path) -> Trace:
    try:
        return Trace.read_jsonl(path)
    except FileNotFoundError:
        raise GeotrainError(f"{path}: file not found") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise GeotrainError(f"{path}: not a geotrain trace ({type(e).__name__}: {e})") from None


def rebuild(run_dir: str | Path, with_trace: bool = False):
    """`geotrain report`: rebuild timeline.png and report.html (and the measured trace's Chrome
    JSON) from the files in `run_dir`. Returns the files, the main trace's metrics and the
    measured trace (None if absent) -- and the main trace itself with `with_trace`."""
    d = Path(run_dir)
    if not d.is_dir():
        raise GeotrainError(f"{d}: not a directory")
    if remerge(d, MEASURED_NAME) is not None:     # other hosts' RUN_DIR/trace files copied in since the run
        write_measured_chrome(d)
    predicted_path = next((d / n for n in PREDICTED_NAMES if (d / n).exists()), None)
    measured_path = d / MEASURED_NAME if (d / MEASURED_NAME).exists() else None
    if predicted_path is None and measured_path is None:
        raise GeotrainError(f"{d}: no trace.jsonl, predicted_trace.jsonl or {MEASURED_NAME} in this directory")
    doc: dict[str, Any] = {}
    if (d / "metrics.json").exists():
        try:
            doc = json.loads((d / "metrics.json").read_text())
        except json.JSONDecodeError as e:
            raise GeotrainError(f"{d / 'metrics.json'}: not valid JSON ({e})") from None
    plan = load_plan(d / "plan.json")[0] if (d / "plan.json").exists() else None

    main = read_trace(predicted_path or measured_path)  # type: ignore[arg-type]
    measured = read_trace(measured_path) if (predicted_path and measured_path) else None
    load = _machine_load(d)
    if measured is not None and load:
        measured = Trace(measured.events, num_ranks=measured.num_ranks, source=measured.source,
                         meta={**(measured.meta if isinstance(measured.meta, dict) else {}), "machine_load": load})
    tokens = int(doc.get("tokens_per_iteration") or main.meta.get("tokens_per_iteration", 0) or 0)
    peak = {int(r): float(v) for r, v in (doc.get("peak_memory") or {}).items()}
    run_predicted, run_measured = _run_memory(d, plan)
    peak = peak or (run_predicted if predicted_path else run_measured)
    metrics = _metrics(main, tokens, peak, str(predicted_path or measured_path))
    # Compared in steady state: the first measured iterations are left out (compare.steady_state).
    measured_metrics = _metrics(steady_state(measured), tokens, run_measured or None, str(measured_path)) \
        if measured is not None else None
    counted = _link_counters(d)
    if measured_metrics is not None and counted is not None:   # per iteration of the whole run
        steps = max(1, len({e.iteration for e in measured.events}))
        measured_metrics = replace(measured_metrics, wan_bytes=int(counted / steps))
    schedules = [ScheduleRow(**r) for r in doc.get("schedule_comparison") or []] or None

    if measured_path is not None:
        write_measured_chrome(d, plan)
    rows = read_rows(d / "losses.jsonl")
    curves = draw_curves(d) if rows else None
    files = build_report(d, main, metrics, plan=plan, measured=measured, measured_metrics=measured_metrics,
                         schedules=schedules, tokens_per_iteration=tokens, bubbletea=bubbletea_rows(d),
                         gpu_memory=doc.get("gpu_memory_per_dc") or None,
                         notes=[f"rebuilt from {d}"] + ([f"measured trace: {measured_path.name}"] if measured else [])
                         + _replan_notes(d), losses_png=d / "losses.png" if (d / "elastic.jsonl").exists() else None,
                         curves_png=curves, curves_caption=summary_line(rows) if rows else "")
    return (files, metrics, measured, main) if with_trace else (files, metrics, measured)


def _machine_load(d: Path) -> dict | None:
    """RUN_DIR/machine_load.json (other runnable threads etc. while the run trained), or None; a bad
    file is ignored, not fatal."""
    try:
        load = json.loads((d / MACHINE_LOAD_NAME).read_text())
        return load if isinstance(load, dict) and isinstance(load.get("background_runnable"), (int, float)) else None
    except (OSError, ValueError):
        return None


def _link_counters(d: Path) -> float | None:
    """Bytes the emulated WAN links counted over the whole run (RUN_DIR/wan_bytes.json, each DC's
    "out"), or None without that file. The runtime records no events for its collectives, so
    these counters -- every byte that crossed, the setup's few KB included -- are the measured
    WAN bytes beside the prediction (layout.wan_bytes); a bad file is ignored, not fatal."""
    try:
        per_dc = json.loads((d / LINK_COUNTERS_NAME).read_text())
        return float(sum(float(v["out"]) for v in per_dc.values()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _replan_notes(d: Path) -> list[str]:
    """One line per re-plan of an elastic run (RUN_DIR/elastic.jsonl); the traces show the last layout."""
    path = d / "elastic.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
            b, a = e["before"], e["after"]
            out.append(f"re-plan {e['replan']}: lost {e['lost_dc']}, resumed at step {e['resume_step']} from "
                       f"{e['checkpoint']}: pp {b['pp']} x dp {b['dp']} -> pp {a['pp']} x dp {a['dp']} "
                       f"(timelines: the last layout)")
        except (ValueError, KeyError, TypeError):
            continue
    return out

