"""`geotrain simulate`: predict one training plan on its cluster, write its trace and report.

Writes OUT/trace.jsonl, trace.chrome.json (ui.perfetto.dev), timeline.png, metrics.json, plan.json
and report.html, which also compares every schedule kind on the same layout
(`schedule_kinds.compare_schedules`); with a BubbleTea workload, the prefill served from the
simulated bubbles (bubbletea.json, bubbletea_timeline.png).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from geotrain.bubbletea.simulated import bubbletea_for_plan, check_no_overlap, parse_workload, prefill_events
from geotrain.console import format_table, human_bytes, human_rate, human_seconds
from geotrain.costs import CostModel
from geotrain.costs.unit_times import read_unit_profile
from geotrain.errors import GeotrainError
from geotrain.layout.plan import load_plan, plan_spec, save_plan
from geotrain.layout.plan_check import check_plan_for_spec
from geotrain.layout.workers import describe_outer
from geotrain.orchestrate.schedule_kinds import compare_schedules
from geotrain.orchestrate.spec_check import load_experiment
from geotrain.planner.confirm import make_plan
from geotrain.planner.variants import schedule_variant
from geotrain.report.build import build_report
from geotrain.report.summary import bubble_summary, gpu_memory_per_dc, metrics_document
from geotrain.report.timeline import draw_timeline
from geotrain.schedule.builders import BUILDERS
from geotrain.sim import SimResult, simulate
from geotrain.trace.chrome import write_chrome
from geotrain.trace.metrics import trace_columns
from geotrain.trace.rank_roles import rank_layout
from geotrain.trace.schema import Trace, json_text


def simulate_command(source: str, out: str, plan_path: str | None = None, schedule: str | None = None,
                     iterations: int = 1, compare: bool = True, progress: bool = True, p2p: str = "overlapped",
                     profile_path: str | None = None, bubbletea: str | None = None, timeline: bool = True,
                     say=print) -> SimResult:
    """`geotrain simulate`: `source` an experiment TOML (simulated with the planner's choice, or the
    plan file `plan_path`) or a plan file; writes OUT (see the module docstring) and prints a summary."""
    if iterations < 1:
        raise GeotrainError(f"--iterations must be >= 1 (got {iterations})")
    if schedule is not None and schedule not in BUILDERS:
        raise GeotrainError(f"unknown schedule kind {schedule!r} (known: {', '.join(BUILDERS)})")
    spec, plan_file = _experiment(source, plan_path)
    # a bad workload is refused before the simulation, not after its output
    workload = parse_workload(bubbletea, spec.bubbletea) if bubbletea else None
    out_dir = _out_dir(out)
    profile = read_unit_profile(profile_path) if profile_path else None
    if plan_file is None:
        # What `geotrain plan SPEC` chooses -- also for a job that pins pp/dp, so plan, simulate and
        # train place it alike (the estimate-only pick can differ from the simulated one).
        say(f"planning {spec.name} (pass --plan to simulate another plan)")
        plan_file = make_plan(spec, profile=profile).plan
    plan = schedule_variant(plan_file, schedule, spec.model.num_units, spec)[0] if schedule else plan_file
    check_plan_for_spec(spec, plan)
    cost = None if profile is None else CostModel(spec.model, precision=plan.precision,
                                                  checkpointing=plan.checkpointing, optimizer=spec.job.optimizer,
                                                  profile=profile, ep=plan.ep)
    try:
        res = simulate(spec, plan, iterations=iterations, progress=progress and sys.stderr.isatty(), cost=cost,
                       p2p=p2p)
    except ValueError as e:
        raise GeotrainError(f"cannot simulate plan {plan.name}: {e}") from None
    res.trace.write_jsonl(out_dir / "trace.jsonl")
    write_chrome(res.trace, out_dir / "trace.chrome.json", plan)
    save_plan(out_dir / "plan.json", plan, spec=spec)
    schedules = None
    if compare and p2p == "overlapped":   # the other kinds run geotrain's own P2P
        schedules = compare_schedules(spec, plan, iterations, known={plan.schedule: res.metrics},
                                      progress=None if progress else False, cost=cost)
    notes = [f"spec {spec.path}", f"{iterations} iteration(s) simulated"] + \
        ([f"measured profile {profile_path}"] if profile is not None else [])
    files = _write_report(spec, plan, res, schedules, out_dir, notes, timeline)
    _print_summary(plan, res, schedules, iterations, say)
    bt_files = _bubbletea(workload, spec, res, out_dir, say) if workload is not None else []
    say("")
    say("wrote:")
    for f in [*(out_dir / n for n in ("trace.jsonl", "trace.chrome.json", "plan.json", "metrics.json")),
              files.timeline, files.html, *bt_files]:
        if f is not None:
            say(f"  {f}")
    return res


def _experiment(source: str, plan_path: str | None):
    """(spec, the plan to simulate or None: the planner's choice)."""
    if Path(source).suffix == ".json":     # a plan file: simulate its plan on its own embedded experiment
        if plan_path:
            raise GeotrainError("give a plan file either as SPEC_OR_PLAN or as --plan, not both")
        plan, doc = load_plan(source)
        return plan_spec(doc, source), plan
    spec = load_experiment(source)
    return spec, load_plan(plan_path)[0] if plan_path else None


def _out_dir(out: str) -> Path:
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise GeotrainError(f"--out {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GeotrainError(f"--out {path}: cannot create the directory ({e.strerror or e})") from None
    return path


def _write_report(spec, plan, res, schedules, out: Path, notes: list[str], timeline: bool = True):
    """OUT/metrics.json, the timeline (unless `timeline` is False) and report.html."""
    m = res.metrics
    layout = rank_layout(res.trace, plan)
    gpu_mem = gpu_memory_per_dc(spec)
    tokens = plan.global_batch * spec.model.seq_len
    doc = metrics_document(m, layout, plan=plan, tokens_per_iteration=tokens, gpu_memory=gpu_mem,
                           schedules=[r.as_dict() for r in schedules] if schedules is not None else None)
    (out / "metrics.json").write_text(json_text(doc, indent=1) + "\n")
    return build_report(out, res.trace, m, plan=plan, schedules=schedules, gpu_memory=gpu_mem,
                        tokens_per_iteration=tokens, title=f"geotrain simulate: {spec.name} ({plan.name})",
                        notes=notes, timeline=timeline)


def _print_summary(plan, res, schedules, iterations: int, say) -> None:
    m = res.metrics
    bs = bubble_summary(m, len(rank_layout(res.trace, plan)))
    say(f"simulated {plan.name}: {plan.schedule}, pp={plan.pp} x dp={plan.dp}"
        + (f" x tp={plan.tp_label()}" if max(plan.stage_tps) > 1 else "")
        + (f", ep={plan.ep}" if plan.ep > 1 else "")
        + f" ({plan.num_ranks} GPUs), {plan.num_microbatches} micro-batches of {plan.micro_batch}, "
        f"{iterations} iteration(s)"
        + (f"; {describe_outer(plan.outer)} (per step: the slowest worker's plus its share of each exchange)"
           if plan.outer else "")
        + "".join(f"; boundaries over {lp.src_dc}-{lp.dst_dc} sent {lp.compression}"
                  + (f" at rank {lp.rank}" if lp.rank else "") for lp in plan.links
                  if lp.compression != "none" or lp.rank))
    say(format_table(["metric", "value"], [
        ["iteration time", human_seconds(m.iteration_time)],
        ["tokens/s", human_rate(m.tokens_per_s, "tok/s")],
        ["mean utilization", f"{100 * m.mean_utilization:.1f}%"],
        ["bubbles", f"{bs.count} intervals, {human_seconds(bs.per_gpu_iteration_s)} per GPU per iteration "
                    f"({100 * bs.fraction:.1f}% of GPU time)"],
        ["WAN bytes / iteration", human_bytes(m.wan_bytes)],
        ["peak memory (max GPU)", human_bytes(max(m.peak_memory.values())) if m.peak_memory else "-"],
    ]))
    if schedules:
        best = min((r.iteration_time for r in schedules if r.iteration_time), default=None)
        say("")
        say(format_table(["schedule", "iteration", "vs best", "util", "bubbles", "note"], [
            [r.kind + (" *" if r.kind == plan.schedule else ""),
             human_seconds(r.iteration_time) if r.iteration_time else "-",
             f"{r.iteration_time / best:.2f}x" if r.iteration_time and best else "-",
             f"{100 * r.mean_utilization:.1f}%" if r.mean_utilization is not None else "-",
             f"{100 * r.bubble_fraction:.1f}%" if r.bubble_fraction is not None else "-",
             r.note if len(r.note) <= 90 else r.note[:87] + "..."] for r in schedules]))


def _bubbletea(cfg, spec, res, out, say) -> list:
    """Serve the workload from the simulated bubbles; print the table, draw the filled timeline."""
    bt = bubbletea_for_plan(spec, res, cfg)
    check_no_overlap(res.trace, bt.result, cfg.fill_dp_reduction)   # prefill only in bubbles: training unchanged
    r = bt.result
    say("")
    say(f"BubbleTea: prefill of {bt.inference_model} in the bubbles "
        f"({len(bt.ranks_simulated)} representative GPUs serve a proportional share of the stream)")
    rows = [list(x) for x in r.summary_rows()]
    rows.append(["training actions moved", "none (prefill only inside predicted bubbles)"])
    rows.append(["inference models that fit beside training", ", ".join(bt.models_that_fit) or "none"])
    if bt.ranks_without_room:
        rows.append(["GPUs without room for the inference model", str(len(bt.ranks_without_room))])
    say(format_table(["BubbleTea", "value"], rows))
    # The filled timeline: iteration 0 of the serving ranks, with their prefill chunks.
    cols = trace_columns(res.trace)
    # Waits are left out: prefill is what the GPU computes while it waits.
    mask = np.isin(cols.rank, bt.ranks_simulated) & (cols.iteration == 0) & ~cols.kind_mask({"recv_wait"})
    events = cols.select(mask).to_events()
    t0 = min((e.start for e in events), default=0.0)
    filled = Trace(events + prefill_events(r, iteration_start=t0, until=r.period), num_ranks=res.trace.num_ranks,
                   source="sim", meta=dict(res.trace.meta))
    png = out / "bubbletea_timeline.png"
    draw_timeline(filled, png, res.plan, title=f"BubbleTea: {spec.name}, prefill in the bubbles (iteration 0)",
                  only=bt.ranks_simulated)
    doc = {"config": asdict(cfg), "inference_model": bt.inference_model,
           "summary": dict(r.summary_rows()), "utilization_without": r.utilization_without,
           "utilization_with": r.utilization_with, "ttft_p50_s": r.ttft_p50, "ttft_p99_s": r.ttft_p99,
           "prefill_tokens_per_s_simulated_gpus": r.prefill_tokens_per_s, "served": r.served, "refused": r.refused,
           "ranks_simulated": bt.ranks_simulated, "models_that_fit": bt.models_that_fit}
    (out / "bubbletea.json").write_text(json_text(doc, indent=1) + "\n")
    return [png, out / "bubbletea.json"]
