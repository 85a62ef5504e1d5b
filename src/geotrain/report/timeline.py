"""Timeline (Gantt) pictures of a trace: one row per GPU, one colour per kind of work.

Why it is drawn this way: a pipeline's bubbles are what the picture is for, so idle time is the
row's light background and every kind of work is a solid colour on top of it. Each kind is a
single PolyCollection over all rows (a few draw calls whatever the rank count), and above
`max_rows` ranks only a few DP replicas of each stage are drawn (replica 0 and up to three more,
evenly spaced) -- replicas of a stage run the same list and differ only in when they get a shared
WAN link, so that subset shows the pipeline's shape; the panel title says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from geotrain.layout.plan import Plan  # noqa: E402
from geotrain.trace.metrics import Columns, trace_columns  # noqa: E402
from geotrain.trace.rank_roles import RankInfo, plan_of, rank_layout  # noqa: E402
from geotrain.trace.schema import Trace  # noqa: E402

# kind -> (colour, legend label), in legend order.
KIND_STYLE: dict[str, tuple[str, str]] = {
    "forward": ("#3b75af", "forward"),
    "backward": ("#e1812c", "backward"),
    "backward_input": ("#c03d3e", "backward (input grad)"),
    "backward_weight": ("#f2b36b", "backward (weight grad)"),
    "recv_wait": ("#b9b0d9", "waiting on a transfer"),
    "allreduce": ("#3a923a", "DP reduction"),
    "optimizer": ("#7d5ba6", "optimizer"),
    "prefill": ("#2ab0b8", "prefill (BubbleTea)"),
    "transfer": ("#8c6d58", "link busy (transfer)"),
    "outer_wait": ("#e3c567", "waiting on the outer exchange (DiLoCo)"),
    "outer_step": ("#9c6b1e", "outer optimizer step (DiLoCo)"),
    "outer_sync": ("#c9a227", "outer exchange on the link (DiLoCo)"),
}
LINK_KINDS = frozenset({"transfer", "turn", "outer_sync"})   # drawn on the link rows, not the GPU's
IDLE_COLOUR = "#eeeeee"
LABELLED_KINDS = frozenset({"forward", "backward", "backward_input", "backward_weight", "prefill"})
BAR_HEIGHT = 0.8
MAX_ROWS = 64           # above this many ranks, draw a subset (rows of one stage's replicas look alike)
REPLICAS_SHOWN = 4       # DP replicas drawn per stage when there are too many ranks to draw all


@dataclass
class Rows:
    """Which ranks get a row, in order, and the note explaining any subsetting."""

    ranks: list[int]
    infos: list[RankInfo]
    links: list[str]
    note: str
    total_ranks: int


def select_rows(trace: Trace, plan: Plan | None = None, max_rows: int = MAX_ROWS, show_links: bool = True,
                only: Sequence[int] | None = None) -> Rows:
    """`only`: draw exactly these ranks (e.g. the ones a BubbleTea study served from)."""
    layout = rank_layout(trace, plan)
    plan = plan_of(trace, plan)
    n = len(layout)
    note = ""
    if only is not None:
        ranks = list(only)
        if len(ranks) < n:
            note = f"{len(ranks)} of {n:,} GPUs shown"
    elif n <= max_rows:
        ranks = list(range(n))
    elif plan is not None:
        stages = list(range(plan.pp))
        if len(stages) > max_rows:
            step = math.ceil(len(stages) / max_rows)
            stages = stages[::step]
        # A few DP replicas per stage, evenly spaced (they differ when pipelines share a WAN link
        # in turns); replica 0 always.
        k = max(1, min(REPLICAS_SHOWN, plan.dp, max_rows // len(stages)))
        reps = sorted({round(i * (plan.dp - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]
        ranks = [plan.rank(s, d, 0) for s in stages for d in reps]
        which = "replica 0 of each" if reps == [0] else f"replicas {', '.join(map(str, reps))} of each"
        of = f"of the {plan.pp} stages" if len(stages) == plan.pp else f"of {len(stages)} of the {plan.pp} stages"
        note = f"{which} {of}{' (tp rank 0)' if plan.tp > 1 else ''} shown, {n:,} GPUs in all"
    else:
        step = math.ceil(n / max_rows)
        ranks = list(range(0, n, step))
        note = f"every {step}th rank shown ({n:,} GPUs in all)"
    links: list[str] = []
    if show_links:
        cols = trace_columns(trace)
        codes = np.unique(cols.link[cols.kind_mask({"transfer", "outer_sync"}) & (cols.link >= 0)]).tolist()
        names = {cols.link_names[c] for c in codes}
        links = sorted(names, key=lambda s: ("->" not in s, s))
    return Rows(ranks, [layout[r] for r in ranks], links, note, n)


def _time_unit(span: float) -> tuple[float, str]:
    if span >= 120:
        return 1.0 / 60, "min"
    if span >= 2:
        return 1.0, "s"
    if span >= 2e-3:
        return 1e3, "ms"
    return 1e6, "us"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _rects(x0: np.ndarray, x1: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Bar extents and rows -> (N, 4, 2) vertex array of bars centred on their rows."""
    x0, x1, y = (np.asarray(v, dtype=float).ravel() for v in (x0, x1, y))
    lo, hi = y - BAR_HEIGHT / 2, y + BAR_HEIGHT / 2
    return np.stack([np.stack([x0, lo], 1), np.stack([x0, hi], 1), np.stack([x1, hi], 1), np.stack([x1, lo], 1)], 1)


def _row_ticks(rows: Rows, max_labels: int = 64) -> tuple[list[float], list[str]]:
    """Tick positions and labels of the GPU rows: every row when few; else the first row of
    each stage (the stage's rank range); else evenly spaced rows."""
    infos = rows.infos

    def full(info: RankInfo) -> str:
        return f"{info.label} · {info.dc}" if info.dc != "?" else info.label

    if len(infos) <= max_labels:
        return [float(i) for i in range(len(infos))], [full(x) for x in infos]
    starts = [i for i in range(len(infos)) if i == 0 or infos[i].stage != infos[i - 1].stage]
    if len(starts) <= max_labels and infos[0].stage >= 0:
        ends = starts[1:] + [len(infos)]
        labels = [f"s{infos[a].stage}: r{infos[a].rank}-r{infos[b - 1].rank} · {infos[a].dc}"
                  for a, b in zip(starts, ends)]
        return [float(i) for i in starts], labels
    every = math.ceil(len(infos) / max_labels)
    return [float(i) for i in range(0, len(infos), every)], [full(infos[i]) for i in range(0, len(infos), every)]


Spans = dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]   # kind -> (x0, x1, row)


def _bars(ax: plt.Axes, spans: Spans, nrows: int, t_end: float, edges: bool) -> None:
    """Idle background for rows 0..nrows-1, then one PolyCollection per kind on top."""
    ys = np.arange(nrows, dtype=float)
    ax.add_collection(PolyCollection(_rects(np.zeros(nrows), np.full(nrows, t_end), ys),
                                     facecolors=IDLE_COLOUR, edgecolors="none"))
    for kind, (x0, x1, y) in spans.items():
        colour = KIND_STYLE.get(kind, ("#999999", kind))[0]
        ax.add_collection(PolyCollection(_rects(x0, x1, y), facecolors=colour,
                                         edgecolors="white" if edges else "none", linewidths=0.3))
    ax.set_ylim(nrows - 0.4, -0.6)
    ax.set_xlim(0, t_end * 1.002 if t_end > 0 else 1)
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", color="#cccccc", lw=0.4)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _row_index(cols: Columns, ranks: list[int]) -> np.ndarray:
    """Row of each event's rank, -1 for ranks not drawn."""
    size = max([int(cols.rank.max()) + 1 if len(cols) else 0] + [r + 1 for r in ranks])
    lut = np.full(size, -1, dtype=np.int64)
    lut[np.asarray(ranks, dtype=np.int64)] = np.arange(len(ranks))
    return lut[cols.rank] if len(cols) else np.zeros(0, dtype=np.int64)


def draw_on_axes(ax: plt.Axes, trace: Trace, rows: Rows, t_end: float, scale: float) -> set[str]:
    """Draw the GPU rows of `trace` on `ax` (top to bottom); returns the kinds that appear."""
    cols = trace_columns(trace)
    row = _row_index(cols, rows.ranks)
    keep = (row >= 0) & (cols.end > cols.start) & ~cols.kind_mask(LINK_KINDS)   # on the link, not the GPU
    spans: Spans = {}
    for code in np.unique(cols.kind[keep]).tolist():
        m = keep & (cols.kind == code)
        spans[cols.kind_names[code]] = (cols.start[m] * scale, cols.end[m] * scale, row[m])
    _bars(ax, spans, len(rows.ranks), t_end * scale, edges=len(rows.ranks) <= 48)
    _label_microbatches(ax, cols, row, t_end, scale, len(rows.ranks))

    # Rows: labels, DC separators and DC names on the right.
    ticks, labels = _row_ticks(rows)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8 if len(rows.ranks) <= 32 else 6)
    start = 0
    for i in range(1, len(rows.infos) + 1):
        if i == len(rows.infos) or rows.infos[i].dc != rows.infos[start].dc:
            if i < len(rows.infos):
                ax.axhline(i - 0.5, color="#444444", lw=0.8)
            if rows.infos[start].dc != "?":
                # Vertical when the DC's block is tall enough for it, else horizontal.
                tall = (i - start) >= 0.3 * len(rows.infos[start].dc)
                ax.annotate(rows.infos[start].dc, xy=(1.003, (start + i - 1) / 2), xycoords=("axes fraction", "data"),
                            va="center", ha="left", fontsize=9, fontweight="bold", rotation=90 if tall else 0)
            start = i

    # Iteration boundaries when the trace holds several iterations.
    its = np.unique(cols.iteration)
    for it in its[:-1].tolist():
        ax.axvline(cols.end[cols.iteration == it].max() * scale, color="#222222", lw=0.8, ls=":")
    return set(spans)


def draw_links(ax: plt.Axes, trace: Trace, links: list[str], t_end: float, scale: float) -> set[str]:
    """One row per link: when it is sending (union of the transfers). A transfer event ends when
    its last byte arrives; the link itself is busy only until that byte left, one propagation
    latency earlier (from the trace's link metadata), or a long-haul link would look saturated."""
    cols = trace_columns(trace)
    meta = trace.meta.get("links", {}) if isinstance(trace.meta, dict) else {}
    spans = {}
    for kind in ("transfer", "outer_sync"):      # pipeline transfers; DiLoCo's exchanges
        pts: list[tuple[float, float, float]] = []
        for i, name in enumerate(links):
            if name not in cols.link_names:
                continue
            m = cols.kind_mask({kind}) & (cols.link == cols.link_names.index(name))
            lat = float((meta.get(name) or {}).get("latency_s", 0.0)) if kind == "transfer" else 0.0
            start = cols.start[m]
            end = np.maximum(start, cols.end[m] - lat)
            pts += [(a * scale, b * scale, float(i)) for a, b in _union(list(zip(start.tolist(), end.tolist())))]
        if pts:
            arr = np.asarray(pts, dtype=float).reshape(-1, 3)
            spans[kind] = (arr[:, 0], arr[:, 1], arr[:, 2])
    _bars(ax, spans, len(links), t_end * scale, edges=False)
    ax.set_yticks(range(len(links)))
    ax.set_yticklabels([f"link {name}" for name in links], fontsize=8)
    return set(spans)


def _label_microbatches(ax: plt.Axes, cols: Columns, row: np.ndarray, t_end: float, scale: float,
                        nrows: int) -> None:
    """Micro-batch numbers inside compute bars, when the picture is small enough to read them
    (few rows, bars wide enough for the digits)."""
    if nrows > 32 or t_end <= 0:
        return
    m = (row >= 0) & (cols.mb >= 0) & cols.kind_mask(LABELLED_KINDS) & (cols.end - cols.start >= 0.012 * t_end)
    if m.sum() > 1500:
        return
    size = 7 if nrows <= 16 else 5
    for x, y, mb in zip(((cols.start[m] + cols.end[m]) / 2 * scale).tolist(), row[m].tolist(), cols.mb[m].tolist()):
        ax.text(x, y, str(mb), ha="center", va="center", fontsize=size, color="white", clip_on=True)


def _trace_end(trace: Trace) -> float:
    cols = trace_columns(trace)
    return float(cols.end.max()) if len(cols) else 0.0


def _iterations(trace: Trace) -> int:
    """How many training iterations a trace holds (the label must not call 3 of them one span)."""
    cols = trace_columns(trace)
    if not len(cols):
        return 0
    fwd = cols.kind_mask({"forward"})
    return int(len(set(cols.iteration[fwd].tolist())))


def draw_timelines(panels: Sequence[tuple[str, Trace]], path: str | Path, plan: Plan | None = None,
                   title: str | None = None, max_rows: int = MAX_ROWS, show_links: bool = True,
                   dpi: int = 110, only: Sequence[int] | None = None) -> Path:
    """Draw one or more traces stacked, sharing the time axis (e.g. predicted over measured).
    Each panel is a GPU axes plus, when the trace has transfers, a link axes below it."""
    panels = list(panels)
    if not panels:
        raise ValueError("nothing to draw")
    rows = [select_rows(t, plan, max_rows, show_links, only) for _, t in panels]
    t_end = max(_trace_end(t) for _, t in panels)
    scale, unit = _time_unit(t_end)
    most = max(len(r.ranks) for r in rows)
    row_h = 0.3 if most <= 24 else max(0.07, 7.0 / most)
    heights: list[float] = []
    for r in rows:
        heights.append(max(1.0, len(r.ranks) * row_h + 0.3))
        if r.links:
            heights.append(len(r.links) * 0.28 + 0.1)
    fig_h = min(60.0, sum(heights) + 1.4 + 0.35 * len(panels))
    fig, axes = plt.subplots(len(heights), 1, figsize=(14, fig_h), sharex=True, layout="constrained",
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    kinds: set[str] = set()
    k = 0
    for (name, trace), r in zip(panels, rows):
        ax = axes[k, 0]
        kinds |= draw_on_axes(ax, trace, r, t_end, scale)
        n_it = _iterations(trace)
        span = f"{_trace_end(trace) * scale:.4g} {unit}"
        sub = f"{name}: iteration span {span}" if n_it <= 1 else f"{name}: {n_it} iterations in {span}"
        if r.note:
            sub += f" — {r.note}"
        ax.set_title(sub, fontsize=10, loc="left")
        k += 1
        if r.links:
            kinds |= draw_links(axes[k, 0], trace, r.links, t_end, scale)
            k += 1
    axes[-1, 0].set_xlabel(f"time ({unit})")
    handles = [Patch(facecolor=KIND_STYLE[kd][0], label=KIND_STYLE[kd][1]) for kd in KIND_STYLE if kd in kinds]
    handles += [Patch(facecolor="#999999", label=kd) for kd in sorted(kinds - set(KIND_STYLE))]
    handles.append(Patch(facecolor=IDLE_COLOUR, edgecolor="#bbbbbb", label="idle (bubble)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5), fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=12)
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def draw_timeline(trace: Trace, path: str | Path, plan: Plan | None = None, title: str | None = None,
                  max_rows: int = MAX_ROWS, show_links: bool = True, dpi: int = 110,
                  only: Sequence[int] | None = None) -> Path:
    """One trace's timeline as a PNG: a row per GPU (rank / stage / DC), link rows below."""
    label = "measured" if trace.source == "measured" else "simulated"
    return draw_timelines([(label, trace)], path, plan, title, max_rows, show_links, dpi, only)
