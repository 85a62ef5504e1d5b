"""Rows a GPU check measured itself, in the GPU validation's table format.

`scripts/gpu_check.py`'s `predict` step trains a plan on the GPU (its `single` run), measures the
plan's units on that device (`calibrate.timers.measure_units`, CUDA events), simulates the plan with
that measured profile and writes one row -- measured step time and peak memory beside the
prediction -- to OUT/gpu_measured.json; `bench/bench_validate_gpu.py --measured FILE` adds such rows
to docs/VALIDATION.md under the published runs. Memory here is allocated bytes on both sides
(`torch.cuda.max_memory_allocated` vs the cost model's peak), not nvidia-smi's device figure.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from geotrain.calibrate.timers import measure_units
from geotrain.costs import CostModel
from geotrain.errors import GeotrainError
from geotrain.layout.plan import load_plan, plan_spec
from geotrain.sim import simulate

FIELDS = ("run", "layout", "device", "measured_s", "predicted_s", "measured_mem", "predicted_mem", "when")


def predict_run_dir(run_dir: str | Path, device: str, name: str, repeats: int = 10) -> dict[str, Any]:
    """One row for a finished `geotrain train` run: its steady-state step time (steps after the first)
    and measured peak against the simulation of its plan with unit times measured now on `device`."""
    run_dir = Path(run_dir)
    try:
        losses = [json.loads(x) for x in (run_dir / "losses.jsonl").read_text().splitlines() if x.strip()]
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GeotrainError(f"{run_dir}: not a finished run ({e})") from None
    plan, doc = load_plan(run_dir / "plan.json")
    spec = plan_spec(doc, run_dir / "plan.json")
    profile = measure_units(spec.model, micro_batches=(plan.micro_batch,), precision=plan.precision,
                            repeats=repeats, device=device)
    cost = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing,
                     optimizer=spec.job.optimizer, profile=profile, ep=plan.ep)
    res = simulate(spec, plan, cost=cost)
    steps = losses[1:] or losses
    stages = summary.get("memory_per_stage") or []
    return {"run": name, "layout": f"pp{plan.pp} dp{plan.dp} tp{plan.tp}, mbs {plan.micro_batch} x "
                                   f"{plan.num_microbatches}, {plan.precision}, {plan.sharding}",
            "device": device, "measured_s": sum(x["step_time_s"] for x in steps) / len(steps),
            "predicted_s": res.iteration_time,
            "measured_mem": max((s["measured_peak"] for s in stages), default=None),
            "predicted_mem": max(res.metrics.peak_memory.values()) if res.metrics.peak_memory else None,
            "when": time.strftime("%Y-%m-%d %H:%M")}


def append_measured(path: str | Path, row: dict[str, Any]) -> None:
    path = Path(path)
    rows = load_measured(path) if path.exists() else []
    path.write_text(json.dumps(rows + [row], indent=1) + "\n")


def load_measured(path: str | Path) -> list[dict[str, Any]]:
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GeotrainError(f"{path}: cannot read measured GPU rows ({e})") from None
    if not isinstance(rows, list) or any(not isinstance(r, dict) or set(FIELDS) - set(r) for r in rows):
        raise GeotrainError(f"{path}: not a list of measured GPU rows (fields {', '.join(FIELDS)})")
    return rows


def _err(pred: float | None, meas: float | None) -> str:
    return "-" if not pred or not meas else f"{100 * (pred - meas) / meas:+.1f}%"


def measured_markdown(rows: list[dict[str, Any]]) -> str:
    head = ["run (GPU check)", "layout", "device", "iteration meas (s)", "pred (s)", "error",
            "memory meas (GB, allocated)", "pred (GB)", "memory error", "when"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        gb = [("-" if x is None else f"{x / 1e9:.2f}") for x in (r["measured_mem"], r["predicted_mem"])]
        lines.append(f"| {r['run']} | {r['layout']} | {r['device']} | {r['measured_s']:.4f} | {r['predicted_s']:.4f} "
                     f"| {_err(r['predicted_s'], r['measured_s'])} | {gb[0]} | {gb[1]} "
                     f"| {_err(r['predicted_mem'], r['measured_mem'])} | {r['when']} |")
    return "\n".join(lines)
