"""A single self-contained HTML page for a run: plan, metrics, per-stage and per-link tables,
schedule comparison, bubbles, the timeline picture (embedded as base64 so the page can be
mailed or attached to an issue as one file), and predicted-vs-measured when both exist."""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from geotrain.console import human_bytes, human_rate, human_seconds, number_runs
from geotrain.layout.plan import Plan
from geotrain.report.compare import CompareRow, ScheduleRow, format_rel, format_value
from geotrain.report.summary import bubble_summary, stage_rows
from geotrain.trace.metrics import Metrics
from geotrain.trace.rank_roles import RankInfo

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1500px;
color:#222;padding:0 16px}
h1{font-size:1.5em;margin-bottom:0}h2{font-size:1.15em;margin-top:1.8em;border-bottom:1px solid #ddd}
.sub{color:#666;margin-top:4px}
table{border-collapse:collapse;margin:8px 0;font-size:0.9em}
th,td{padding:3px 10px;border-bottom:1px solid #eee;text-align:left}
th{background:#f5f5f5}td.n{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin:12px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:150px}
.card .v{font-size:1.35em;font-weight:600}.card .k{color:#666;font-size:0.85em}
.warn{color:#b00020;font-weight:600}.muted{color:#888}
img{max-width:100%;border:1px solid #eee}
"""


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[bool] | None = None) -> str:
    """An HTML table; cells are escaped; `numeric` columns are right-aligned."""
    numeric = numeric or [False] * len(headers)
    out = ["<table><tr>" + "".join(f"<th>{escape(str(h))}</th>" for h in headers) + "</tr>"]
    for r in rows:
        cells = []
        for i, v in enumerate(r):
            raw = v if isinstance(v, _Raw) else escape("" if v is None else str(v))
            cls = ' class="n"' if i < len(numeric) and numeric[i] else ""
            cells.append(f"<td{cls}>{raw}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(out) + "</table>"


class _Raw(str):
    """Trusted HTML (built here, already escaped)."""


def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _opt(x: float | None, f: Any) -> str:
    return "-" if x is None else f(x)


def _cards(items: Sequence[tuple[str, str]]) -> str:
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="v">{escape(v)}</div><div class="k">{escape(k)}</div></div>'
        for k, v in items) + "</div>"


def plan_section(plan: Plan) -> str:
    head = [
        ("schedule", plan.schedule), ("pipeline stages (pp)", str(plan.pp)), ("data parallel (dp)", str(plan.dp)),
        ("tensor parallel (tp)", plan.tp_label()), ("GPUs", str(plan.num_ranks)),
        ("micro-batches", str(plan.num_microbatches)), ("micro-batch size", str(plan.micro_batch)),
        ("global batch", str(plan.global_batch)), ("chunks per stage", str(plan.virtual_per_stage)),
        ("precision", plan.precision), ("checkpointing", plan.checkpointing_label()), ("sharding", plan.sharding),
    ]
    if plan.extra_warmup:
        head.append(("extra warm-up per stage", ", ".join(map(str, plan.extra_warmup))))
    if plan.pipeline_offsets:
        head.append(("pipeline offsets", ", ".join(human_seconds(x) for x in plan.pipeline_offsets)))
    out = [f"<h2>Plan <span class='muted'>{escape(plan.name)}</span></h2>",
           table(["setting", "value"], head)]
    srows = [(s, "+".join(dict.fromkeys(plan.dc_of(s, d) for d in range(plan.dp))),
              ", ".join(f"[{a}, {b})" for a, b in st.chunks), len(st.units),
              number_runs(plan.stage_ranks(s), "r"))
             for s, st in enumerate(plan.stages)]
    out.append(table(["stage", "DC", "model units", "units", "ranks"], srows, [True, False, False, True, False]))
    if plan.links:
        lrows = [(f"{lp.src_dc} <-> {lp.dst_dc}", lp.connections, lp.sharing,
                  ", ".join(map(str, lp.order)) or "-", human_seconds(lp.stagger_s) if lp.stagger_s else "-")
                 for lp in plan.links]
        out.append(table(["WAN link", "connections", "sharing", "pipeline order", "stagger"], lrows,
                         [False, True, False, False, True]))
    if plan.notes:
        out.append("<ul>" + "".join(f"<li>{escape(n)}</li>" for n in plan.notes) + "</ul>")
    return "\n".join(out)


def metrics_section(metrics: Metrics, layout: list[RankInfo], gpu_memory: dict[str, float] | None,
                    link_meta: dict[str, Any] | None, label: str = "") -> str:
    bs = bubble_summary(metrics, len(layout))
    cards = [("iteration time", human_seconds(metrics.iteration_time))]
    if metrics.tokens_per_s > 0 and not math.isinf(metrics.tokens_per_s):
        cards.append(("tokens / s", human_rate(metrics.tokens_per_s, "tok/s")))
    cards += [("mean GPU utilization", _pct(metrics.mean_utilization)),
              ("bubble fraction", _pct(metrics.bubble_fraction)),
              ("bubble time / GPU / iteration", human_seconds(bs.per_gpu_iteration_s)),
              ("WAN bytes / iteration", human_bytes(metrics.wan_bytes))]
    if metrics.peak_memory:
        cards.append(("peak memory (max GPU)", human_bytes(max(metrics.peak_memory.values()))))
    if metrics.iterations > 1:
        cards.append(("iterations simulated", str(metrics.iterations)))
    out = [f"<h2>Metrics{' <span class=muted>(' + escape(label) + ')</span>' if label else ''}</h2>", _cards(cards)]

    rows = []
    for r in stage_rows(metrics, layout, gpu_memory):
        mem = _opt(r.peak_memory, human_bytes)
        if r.peak_memory is not None and r.gpu_memory:
            share = r.peak_memory / r.gpu_memory
            mem_cell = _Raw(f"{escape(mem)} / {escape(human_bytes(r.gpu_memory))} ({100 * share:.1f}%)")
            if share > 1:
                mem_cell = _Raw(f"<span class='warn'>{mem_cell} over GPU memory</span>")
        else:
            mem_cell = mem
        rows.append((r.stage if r.stage >= 0 else "?", r.dc, r.ranks, _pct(r.busy_fraction),
                     human_seconds(r.bubble_s), mem_cell))
    out.append("<h3>Per stage</h3>")
    out.append(table(["stage", "DC", "GPUs", "busy (mean)", "bubble / GPU / iteration", "peak memory / GPU memory"],
                     rows, [True, False, True, True, True, True]))
    if metrics.link_utilization:
        lrows = []
        for name, u in sorted(metrics.link_utilization.items(), key=lambda kv: ("->" not in kv[0], kv[0])):
            info = (link_meta or {}).get(name, {})
            cap = (info.get("capacity_Bps") or info.get("bandwidth_Bps")) if isinstance(info, dict) else None
            lrows.append((name, "WAN" if "->" in name else "intra-DC", _pct(u),
                          _opt(cap, lambda c: human_rate(c * 8, "bit/s"))))
        out.append("<h3>Links</h3>")
        out.append(table(["link", "kind", "utilization", "capacity"], lrows, [False, False, True, True]))
    return "\n".join(out)


def bubbles_section(metrics: Metrics, layout: list[RankInfo]) -> str:
    bs = bubble_summary(metrics, len(layout))
    out = ["<h2>Bubbles</h2>",
           f"<p>{bs.count:,} idle intervals (no training compute); {escape(human_seconds(bs.total_s))} of GPU time "
           f"in all, {_pct(bs.fraction)} of the GPU time; {escape(human_seconds(bs.per_gpu_iteration_s))} per GPU "
           f"per iteration.</p>"]
    if bs.largest:
        info = {i.rank: i for i in layout}
        rows = [(r, info[r].stage if r in info else "?", info[r].dc if r in info else "?", human_seconds(a),
                 human_seconds(b), human_seconds(b - a)) for r, a, b in bs.largest]
        out.append("<h3>Largest bubbles</h3>")
        out.append(table(["rank", "stage", "DC", "start", "end", "length"], rows,
                         [True, True, False, True, True, True]))
    return "\n".join(out)


def schedules_section(rows: Sequence[ScheduleRow], current: str | None) -> str:
    ok = [r for r in rows if r.iteration_time]
    best = min((r.iteration_time for r in ok), default=None)
    body = []
    for r in rows:
        name = _Raw(f"<b>{escape(r.kind)}</b>") if r.kind == current else r.kind
        if r.iteration_time is None:
            body.append((name, "-", "-", "-", "-", "-", "-", r.note))
            continue
        rel = f"{r.iteration_time / best:.2f}x" if best else "-"
        tps = _opt(r.tokens_per_s, lambda x: human_rate(x, "tok/s") if not math.isinf(x) else "-")
        body.append((name, human_seconds(r.iteration_time), rel, tps, _pct(r.mean_utilization),
                     _pct(r.bubble_fraction), _opt(r.peak_memory, human_bytes), r.note))
    return "\n".join(["<h2>Schedule kinds on this layout</h2>",
                      table(["schedule", "iteration time", "vs best", "tokens/s", "utilization", "bubble fraction",
                             "peak memory", "note"], body, [False, True, True, True, True, True, True, False])])


def comparison_section(rows: Sequence[CompareRow]) -> str:
    body = [(r.metric, format_value(r.predicted, r.unit), format_value(r.measured, r.unit), format_rel(r.rel_error),
             r.note) for r in rows]
    return "\n".join(["<h2>Predicted vs measured</h2>",
                      table(["metric", "predicted", "measured", "relative error (predicted - measured) / measured",
                             "why it differs (errors over 10%)"], body, [False, True, True, True, False])])


def image_html(png: Path, embed: bool = True, alt: str = "timeline") -> str:
    if embed:
        data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
        return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'
    return f'<img alt="{escape(alt)}" src="{escape(Path(png).name)}">'


def render_html(*, title: str, metrics: Metrics, layout: list[RankInfo], plan: Plan | None = None,
                timeline_png: Path | None = None, schedules: Sequence[ScheduleRow] | None = None,
                comparison: Sequence[CompareRow] | None = None, gpu_memory: dict[str, float] | None = None,
                link_meta: dict[str, Any] | None = None, notes: Sequence[str] = (), embed: bool = True,
                metrics_label: str = "", bubbletea: Sequence[tuple[str, str]] | None = None,
                losses_png: Path | None = None, curves_png: Path | None = None, curves_caption: str = "") -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>{escape(title)}</h1>"]
    if notes:
        parts.append("<p class='sub'>" + "<br>".join(escape(n) for n in notes) + "</p>")
    if comparison:
        parts.append(comparison_section(comparison))
    parts.append(metrics_section(metrics, layout, gpu_memory, link_meta, metrics_label))
    if bubbletea:
        parts.append("<h2>BubbleTea <span class='muted'>(measured)</span></h2>")
        parts.append(table(["quantity", "value"], list(bubbletea), [False, True]))
    if timeline_png is not None and Path(timeline_png).exists():
        parts.append("<h2>Timeline</h2>")
        parts.append(image_html(timeline_png, embed))
    if curves_png is not None and Path(curves_png).exists():
        parts.append("<h2>Training curves <span class='muted'>(measured, losses.jsonl)</span></h2>")
        if curves_caption:
            parts.append(f"<p>{escape(curves_caption)}</p>")
        parts.append(image_html(curves_png, embed, alt="training curves"))
    if losses_png is not None and Path(losses_png).exists():
        parts.append("<h2>Loss (re-plans shaded)</h2>")       # an elastic run: train --elastic
        parts.append(image_html(losses_png, embed, alt="loss"))
    if schedules:
        parts.append(schedules_section(schedules, plan.schedule if plan else None))
    parts.append(bubbles_section(metrics, layout))
    if plan is not None:
        parts.append(plan_section(plan))
    parts.append("<p class='muted'>generated by geotrain</p></body></html>")
    return "\n".join(parts)


def write_html(path: str | Path, **kw: Any) -> Path:
    """Render the page (see `render_html` for the keywords) and write it."""
    path = Path(path)
    path.write_text(render_html(**kw), encoding="utf-8")
    return path
