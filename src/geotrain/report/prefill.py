"""The BubbleTea part of a training run's report: what the service measured (RUN_DIR/
bubbletea.json, written when the service closes) and, from losses.jsonl, the training slowdown
when the run alternated steps with and without prefill (`--prefill-duty N`).

Every value here is measured; the slowdown is only given when the run measured it.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean


def slowdown(losses: Path, skip: int = 2) -> tuple[float, int, int] | None:
    """(mean step time with prefill / without, steps with, steps without), from a run whose
    losses.jsonl marks each step's "prefill"; None when it has not both kinds. The first `skip`
    steps (start-up) are left out."""
    try:
        rows = [json.loads(x) for x in losses.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return None
    rows = [r for r in rows if isinstance(r, dict) and "prefill" in r and r.get("step", 0) > skip]
    on = [float(r["step_time_s"]) for r in rows if r["prefill"]]
    off = [float(r["step_time_s"]) for r in rows if not r["prefill"]]
    if not on or not off:
        return None
    return mean(on) / mean(off), len(on), len(off)


def bubbletea_rows(run_dir: str | Path) -> list[tuple[str, str]] | None:
    d = Path(run_dir)
    try:
        doc = json.loads((d / "bubbletea.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    codes = doc.get("responses") or {}
    answered = int(doc.get("answered", 0))
    rows = [("requests answered (HTTP 200)", f"{answered}"),
            ("API responses by status (not /healthz, /metrics)",
             ", ".join(f"{c}: {n}" for c, n in sorted(codes.items())) or "none")]
    if answered:
        rows += [("TTFT p50", f"{1e3 * float(doc['ttft_p50_s']):.0f} ms"),
                 ("TTFT p99", f"{1e3 * float(doc['ttft_p99_s']):.0f} ms")]
    prefill_s, bubble_s = float(doc.get("prefill_s", 0.0)), float(doc.get("bubble_s", 0.0))
    rows.append(("prefill on training ranks", f"{prefill_s:.2f} s"))
    rows.append(("prefill share of bubble time", f"{100 * prefill_s / bubble_s:.1f}% of {bubble_s:.2f} s"
                 if bubble_s > 0 else "no bubble time reported"))
    rows.append(("prefill share of rank time", f"{100 * float(doc.get('prefill_share_of_rank_time', 0)):.2f}%"))
    if doc.get("finished_after_training"):
        rows.append(("requests prefilled after training ended", str(doc["finished_after_training"])))
    s = slowdown(d / "losses.jsonl")
    rows.append(("training slowdown (step time with / without prefill)",
                 f"{s[0]:.3f} ({s[1]} steps with, {s[2]} without)" if s else
                 "not measured: train with --prefill-duty N to alternate steps with and without prefill"))
    return rows
