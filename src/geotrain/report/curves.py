"""Training curves from a run's losses.jsonl: loss (and held-out loss), learning rate, gradient norm,
tokens/s and step time per step, drawn as RUN_DIR/curves.png (embedded in report.html).

A row the run could not finish (a NaN loss written as null, a line cut by a crash) is skipped,
never fatal: the curves are drawn from what is there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

CURVES_NAME = "curves.png"


def read_rows(path: Path) -> list[dict]:
    """losses.jsonl's rows (dicts with a "step"); unreadable lines are left out."""
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows where `key` is a finite number."""
    pts = [(r["step"], _num(r.get(key))) for r in rows]
    pts = [(s, v) for s, v in pts if v is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def tokens_per_s(rows: list[dict]) -> tuple[list[int], list[float]]:
    pts = [(r["step"], _num(r.get("tokens")), _num(r.get("step_time_s"))) for r in rows]
    pts = [(s, t / dt) for s, t, dt in pts if t is not None and dt]
    return [s for s, _ in pts], [v for _, v in pts]


def summary_line(rows: list[dict]) -> str:
    """The last step's numbers in one line (the report's caption)."""
    last = rows[-1]
    parts = [f"step {last['step']}"]
    for key, label, fmt in (("loss", "loss", ".4f"), ("lr", "lr", ".3g"), ("grad_norm", "grad norm", ".3g")):
        v = _num(last.get(key))
        if v is not None:
            parts.append(f"{label} {v:{fmt}}")
    _, ev = series(rows, "eval_loss")
    if ev:
        parts.append(f"eval loss {ev[-1]:.4f} (perplexity {math.exp(min(ev[-1], 50)):.3g})")
    return ", ".join(parts)


def draw_curves(run_dir: str | Path) -> Path | None:
    """RUN_DIR/curves.png from RUN_DIR/losses.jsonl; None when there is no row to draw."""
    run_dir = Path(run_dir)
    rows = read_rows(run_dir / "losses.jsonl")
    if not rows:
        return None
    import matplotlib  # heavy: only when there is something to draw

    matplotlib.use("Agg")
    # lazy: matplotlib only when called (importers that never call it stay free of it)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    panels = [("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm (before clipping)"),
              ("tokens_per_s", "tokens / s"), ("step_time_s", "step time (s)"), ("eval_perplexity", "perplexity")]
    for ax, (key, title) in zip(axes.flat, panels):
        if key == "tokens_per_s":
            xs, ys = tokens_per_s(rows)
        elif key == "eval_perplexity":
            xs, ys = series(rows, "loss")
            ys = [math.exp(min(v, 50)) for v in ys]
        else:
            xs, ys = series(rows, key)
        if ys:
            ax.plot(xs, ys, marker="." if len(xs) < 60 else None, lw=1.2, color="tab:blue",
                    label="train" if key in ("loss", "eval_perplexity") else None)
        if key in ("loss", "eval_perplexity"):
            ex, ey = series(rows, "eval_loss")
            if ey:
                ax.plot(ex, ey if key == "loss" else [math.exp(min(v, 50)) for v in ey], marker="o",
                        color="tab:orange", label="held-out")
            if ys or ey:
                ax.legend(fontsize=8)
        if key == "loss":
            skipped = [r["step"] for r in rows if r.get("skipped")]
            for s in skipped:
                ax.axvline(s, color="tab:red", alpha=0.3, lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        if not ys and key not in ("loss", "eval_perplexity"):
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(f"{run_dir.name}: {summary_line(rows)}", fontsize=10)
    fig.tight_layout()
    path = run_dir / CURVES_NAME
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
