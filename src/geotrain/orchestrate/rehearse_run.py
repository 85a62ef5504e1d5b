"""`geotrain rehearse`: a multi-host deployment rehearsed on this machine, then compared.

The rehearsal itself is `rehearsal.run_rehearsal` (one torchrun per emulated DC); this writes the
one plan file every host trains, compares the losses with the built-in launcher's run of the same
plan (trained into RUN_DIR/builtin, or a finished one), and prints per cross-DC link what was
measured, and what crossed each emulated link against `layout.wan_bytes`' prediction.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from geotrain.console import human_bytes, sent_received
from geotrain.errors import GeotrainError
from geotrain.layout.plan import load_plan, plan_spec, save_plan
from geotrain.layout.wan_bytes import predicted_link_bytes
from geotrain.orchestrate.rehearsal import dc_blocks, losses_of, median_step_s, run_rehearsal
from geotrain.orchestrate.spec_check import load_experiment
from geotrain.planner.confirm import make_plan
from geotrain.runtime.host_devices import cuda_available
from geotrain.runtime.train_config import runnable_schedule
from geotrain.trace.schema import json_text


def rehearse(source: str, out: str | None = None, steps: int | None = None, data: str | None = None,
             compare: bool = True, compare_with: str | None = None, rate_scale: float = 1.0, tls: bool = False,
             timeout_s: float = 3600.0, progress: bool = True, say=print) -> bool:
    """Rehearse `source` (a plan file, or a TOML: the planner's choice); True if the losses equal the
    compared run's bit for bit (or nothing was compared). RUN_DIR/rehearse.json holds the report.
    progress=False: the hosts train with --no-progress (no progress lines, no curves.png to draw)."""
    if steps is not None and steps < 1:
        raise GeotrainError("--steps must be at least 1")
    if not timeout_s > 0:
        raise GeotrainError(f"--timeout must be a positive number of seconds (got {timeout_s})")
    if not rate_scale > 0:
        raise GeotrainError("--wan-rate-scale must be positive")
    if compare_with and not (Path(compare_with) / "losses.jsonl").is_file():
        raise GeotrainError(f"--compare-with {compare_with}: no losses.jsonl there")
    spec, plan, name = _plan(Path(source))
    check_rehearsable(spec, plan)
    run_dir = Path(out or Path("runs") / f"{name}-rehearse")
    run_dir.mkdir(parents=True, exist_ok=True)
    plan_path = run_dir / "rehearse_plan.json"          # one plan file: every host and the comparison train it
    save_plan(plan_path, plan, spec=spec)
    train_args = [*(["--steps", str(steps)] if steps else []), *(["--data", data] if data else []),
                  "--wan-rate-scale", str(rate_scale), *(["--wan-tls"] if tls else []),
                  *([] if progress else ["--no-progress"])]
    result = run_rehearsal(spec, plan, plan_path, run_dir, train_args, rate_scale=rate_scale, timeout_s=timeout_s,
                           say=say)
    losses, step = losses_of(run_dir), median_step_s(run_dir)
    say(f"rehearsal: {len(losses)} steps in {result.wall_s:.1f} s wall, median step {step:.3f} s -> {run_dir}")
    report = {"run_dir": str(run_dir), "wall_s": result.wall_s, "median_step_s": step, "losses": losses,
              "links": result.links, "link_bytes": result.link_bytes}
    other = Path(compare_with) if compare_with else None
    if other is None and compare:
        say("comparison: the same plan with the built-in launcher (geotrain train --wan auto) ...")
        other = _builtin(plan_path, run_dir / "builtin", train_args)
    same = _compare(losses, step, other, report, say) if other is not None else True
    if result.links:
        say("\n".join(_link_lines(result.links)))
    if len(result.link_bytes) > 1:     # (one datacenter: no WAN, nothing to compare)
        say("WAN bytes (emulated links, whole run, the process group's collectives included): "
            + sent_received(result.link_bytes))
        backend = "nccl" if cuda_available() else "gloo"     # the ranks ran on this host
        say(f"WAN bytes predicted (layout.wan_bytes, {len(losses)} iterations, {backend}): "
            + sent_received(predicted_link_bytes(spec, plan, len(losses), backend)))
    (run_dir / "rehearse.json").write_text(json_text(report, indent=2) + "\n")
    return same


def check_rehearsable(spec, plan) -> None:
    """Refuse in one line, before any namespace or host starts, what a host's `geotrain train` or
    the rehearsal would refuse: a plan no rank can run (train's own check), a datacenter's ranks
    not in one block (of each DiLoCo worker's job), more datacenters than the emulation holds."""
    runnable_schedule(spec, plan)
    for w in range(plan.num_workers):
        dc_blocks(plan.worker_plan(w))
    if len(plan.worker_dcs()) > 9:
        raise GeotrainError(f"the plan uses {len(plan.worker_dcs())} datacenters; rehearse emulates at most 9")


def _plan(path: Path):
    """(spec, plan, the run's name): a plan file's, else the planner's choice (both checked by check_rehearsable)."""
    if path.suffix == ".json":
        plan, doc = load_plan(path)
        return plan_spec(doc, path), plan, Path(doc.get("spec") or path).stem
    spec = load_experiment(path)
    return spec, make_plan(spec).plan, path.stem


def _compare(losses: list[float], step: float | None, other: Path, report: dict, say) -> bool:
    """Whether `losses` equal `other`'s run bit for bit; says so, and the median steps, into `report` too."""
    theirs = losses_of(other)
    same = losses == theirs
    their_step = median_step_s(other)
    report.update(compare_with=str(other), compare_losses=theirs, losses_identical=same,
                  compare_median_step_s=their_step)
    if same:
        say(f"losses: identical to the built-in launcher's run ({other}), all {len(losses)} steps bit for bit")
    else:
        diff = next((i for i, (a, b) in enumerate(zip(losses, theirs)) if a != b), min(len(losses), len(theirs)))
        say(f"losses: DIFFER from {other} at step {diff + 1} "
            f"({losses[diff] if diff < len(losses) else '-'} vs {theirs[diff] if diff < len(theirs) else '-'})")
    if step and their_step:
        say(f"median step: rehearse {step:.3f} s vs built-in launcher {their_step:.3f} s "
            f"(ratio {step / their_step:.2f})")
    return same


def _builtin(plan_path: Path, out: Path, train_args: list[str]) -> Path:
    """The built-in launcher's run of the same plan file, over the same kind of emulated WAN."""
    argv = [sys.executable, "-m", "geotrain.cli", "train", str(plan_path), "--out", str(out), "--wan", "auto",
            "--checkpoint-every", "0", "--no-progress", *train_args]
    r = subprocess.run(argv, capture_output=True, text=True)
    (out / "train.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "train.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise GeotrainError(f"the built-in launcher's comparison run failed: {last} (log: {out / 'train.log'})")
    return out


def _link_lines(links: list[dict]) -> list[str]:
    w = max([12, *(len(x["link"]) for x in links)])          # long datacenter names keep the columns aligned
    lines = ["per cross-DC link (plan / measured):",
             f"  {'link':<{w}} connections per pair   sharing    turns/iter  held at once  transfers/iter  bytes/iter"]
    for x in links:
        per_pair = sorted(set(x["measured_connections_per_pair"]))
        meas = ",".join(f"{c:g}" for c in per_pair) or "0"
        turns = (f"{x['turns_per_iteration']:g} by {x['turn_pipelines']}" if x["plan_turns"] else
                 f"{x['turns_per_iteration']:g}")
        held = f"{x['turn_slots']} / {x['turns_held_at_once']}" if x["plan_turns"] else f"- / {x['turns_held_at_once']}"
        lines.append(f"  {x['link']:<{w}} {x['plan_connections']:>4} / {meas:<14}  {x['sharing']:<9}  {turns:>10}  "
                     f"{held:>12}  {x['transfers_per_iteration']:>14g}  {human_bytes(x['bytes_per_iteration']):>10}")
    return lines
