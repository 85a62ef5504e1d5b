"""geotrain simulate SPEC --out DIR: predict one training plan on its cluster and report it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from geotrain.console import format_table, human_bytes, human_rate, human_seconds
from geotrain.errors import GeotrainError, SpecError
from geotrain.layout.plan_check import check_plan_for_spec
from geotrain.trace.schema import Trace, json_text

DESCRIPTION = (
    "Simulate the plan of an experiment spec (the layout its [job] pins, or a plan file from "
    "`geotrain plan`) with the discrete-event simulator, then write DIR/trace.jsonl, "
    "DIR/trace.chrome.json (open in ui.perfetto.dev), DIR/timeline.png, DIR/metrics.json, "
    "DIR/plan.json and DIR/report.html, which also compares every schedule kind on the same layout."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC_OR_PLAN",
                   help="experiment TOML (cluster + model + [job]), or a plan file (it carries its experiment)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--plan", metavar="PLAN.json", help="plan file to simulate instead of the job's own layout")
    p.add_argument("--schedule", metavar="KIND",
                   help="schedule kind (gpipe, 1f1b, interleaved, zb-h1, wan-1f1b); default: the plan's / job's")
    p.add_argument("--iterations", type=int, default=1, metavar="N", help="iterations to simulate (default 1)")
    p.add_argument("--no-compare", action="store_true", help="skip simulating the other schedule kinds")
    p.add_argument("--no-progress", action="store_true", help="never show progress bars")
    p.add_argument("--p2p", choices=("overlapped", "blocking"), default="overlapped",
                   help="how the runtime moves pipeline tensors: overlapped (geotrain's: a send does not wait "
                        "for its receive, the default) or blocking (DeepSpeed's pipe engine: blocking send/recv in "
                        "its TrainSchedule order; 1F1B inside one DC)")
    p.add_argument("--profile", metavar="JSON", help="simulate with measured per-unit times (a `geotrain profile` "
                                                    "file or the geotrain.costs.unit_times format: tables at "
                                                    "(micro-batch, tp) points, interpolated) instead of FLOPs")
    p.add_argument("--bubbletea", metavar="WORKLOAD", nargs="?", const="spec",
                   help="also serve prefill requests from the bubbles: a TOML file, key=value pairs "
                        "(e.g. load=0.8,mean_prompt=512,inference_model=llama2-7b) or nothing for the "
                        "spec's [bubbletea] table / defaults")


def _profile(path: str) -> dict:
    """The measured profile at `path`, checked (one-line error otherwise)."""
    # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.commands.estimate_cmd import _load_profile
    from geotrain.costs.unit_times import Profile

    profile = _load_profile(path)
    try:
        Profile(profile)
    except ValueError as e:
        raise SpecError(path, "profile", str(e)) from None
    return profile


def run(args: argparse.Namespace) -> int:
    # lazy: matplotlib, numpy, pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.layout.plan import load_plan, plan_spec, save_plan
    from geotrain.orchestrate.schedule_kinds import compare_schedules
    from geotrain.planner.variants import schedule_variant
    from geotrain.report.build import build_report
    from geotrain.report.summary import bubble_summary, gpu_memory_per_dc, metrics_document
    from geotrain.schedule.builders import BUILDERS
    from geotrain.sim import simulate
    from geotrain.spec import load_spec
    from geotrain.trace.chrome import write_chrome
    from geotrain.trace.rank_roles import rank_layout

    if args.iterations < 1:
        raise GeotrainError(f"--iterations must be >= 1 (got {args.iterations})")
    if args.schedule is not None and args.schedule not in BUILDERS:
        raise GeotrainError(f"unknown schedule kind {args.schedule!r} (known: {', '.join(BUILDERS)})")
    plan_file = None
    if Path(args.spec).suffix == ".json":     # a plan file: simulate its plan on its own embedded experiment
        if args.plan:
            raise GeotrainError("give a plan file either as SPEC_OR_PLAN or as --plan, not both")
        plan_file, doc = load_plan(args.spec)
        spec = plan_spec(doc, args.spec)
    else:
        spec = load_spec(args.spec)
    workload = None
    if args.bubbletea:  # a bad workload is refused before the simulation, not after its output
        # lazy: numpy, pydantic only when the command runs (keeps `geotrain --help` fast)
        from geotrain.bubbletea.simulated import parse_workload

        workload = parse_workload(args.bubbletea, spec.bubbletea)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise GeotrainError(f"--out {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GeotrainError(f"--out {out}: cannot create the directory ({e.strerror or e})") from None
    profile = _profile(args.profile) if args.profile else None
    if plan_file is not None or args.plan:
        plan = plan_file or load_plan(args.plan)[0]
        if args.schedule:
            plan, _ = schedule_variant(plan, args.schedule, spec.model.num_units, spec)
    else:
        # lazy: numpy, pydantic only when the command runs (keeps `geotrain --help` fast)
        from geotrain.planner.confirm import make_plan

        # What `geotrain plan SPEC` chooses -- also for a job that pins pp/dp, so plan, simulate and
        # train place it alike (the estimate-only pick can differ from the simulated one).
        print(f"planning {spec.name} (pass --plan to simulate another plan)", flush=True)
        plan = make_plan(spec, profile=profile).plan
        if args.schedule:
            plan, _ = schedule_variant(plan, args.schedule, spec.model.num_units, spec)
    check_plan_for_spec(spec, plan)
    show = False if args.no_progress else None
    cost = None
    if profile is not None:
        # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
        from geotrain.costs import CostModel

        cost = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing,
                         optimizer=spec.job.optimizer, profile=profile, ep=plan.ep)
    try:
        res = simulate(spec, plan, iterations=args.iterations, progress=bool(show is None and sys.stderr.isatty()),
                       cost=cost, p2p=args.p2p)
    except ValueError as e:
        raise GeotrainError(f"cannot simulate plan {plan.name}: {e}") from None
    m = res.metrics

    res.trace.write_jsonl(out / "trace.jsonl")
    write_chrome(res.trace, out / "trace.chrome.json", plan)
    save_plan(out / "plan.json", plan, spec=spec)

    schedules = None
    if not args.no_compare and args.p2p == "overlapped":   # the other kinds run geotrain's own P2P
        schedules = compare_schedules(spec, plan, args.iterations, known={plan.schedule: m}, progress=show, cost=cost)
    layout = rank_layout(res.trace, plan)
    gpu_mem = gpu_memory_per_dc(spec)
    tokens = plan.global_batch * spec.model.seq_len
    doc = metrics_document(m, layout, plan=plan, tokens_per_iteration=tokens, gpu_memory=gpu_mem,
                           schedules=[r.as_dict() for r in schedules] if schedules is not None else None)
    (out / "metrics.json").write_text(json_text(doc, indent=1) + "\n")
    files = build_report(out, res.trace, m, plan=plan, schedules=schedules, gpu_memory=gpu_mem,
                         tokens_per_iteration=tokens, title=f"geotrain simulate: {spec.name} ({plan.name})",
                         notes=[f"spec {spec.path}", f"{args.iterations} iteration(s) simulated"]
                         + ([f"measured profile {args.profile}"] if profile is not None else []))

    bs = bubble_summary(m, len(layout))
    print(f"simulated {plan.name}: {plan.schedule}, pp={plan.pp} x dp={plan.dp}"
          + (f" x tp={plan.tp_label()}" if max(plan.stage_tps) > 1 else "")
          + (f", ep={plan.ep}" if plan.ep > 1 else "")
          + f" ({plan.num_ranks} GPUs), {plan.num_microbatches} micro-batches of {plan.micro_batch}, "
            f"{args.iterations} iteration(s)")
    print(format_table(["metric", "value"], [
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
        print()
        print(format_table(["schedule", "iteration", "vs best", "util", "bubbles", "note"], [
            [r.kind + (" *" if r.kind == plan.schedule else ""),
             human_seconds(r.iteration_time) if r.iteration_time else "-",
             f"{r.iteration_time / best:.2f}x" if r.iteration_time and best else "-",
             f"{100 * r.mean_utilization:.1f}%" if r.mean_utilization is not None else "-",
             f"{100 * r.bubble_fraction:.1f}%" if r.bubble_fraction is not None else "-",
             r.note if len(r.note) <= 90 else r.note[:87] + "..."] for r in schedules]))
    bt_files = _bubbletea(workload, spec, res, out) if workload is not None else []
    print()
    print("wrote:")
    for name in ("trace.jsonl", "trace.chrome.json", "plan.json", "metrics.json"):
        print(f"  {out / name}")
    print(f"  {files.timeline}")
    print(f"  {files.html}")
    for f in bt_files:
        print(f"  {f}")
    return 0


def _bubbletea(cfg, spec, res, out) -> list:
    """Serve the workload from the simulated bubbles; print the table, draw the filled timeline."""
    # lazy: matplotlib, numpy, pydantic only when the command runs (keeps `geotrain --help` fast)
    import numpy as np

    from geotrain.bubbletea.simulated import bubbletea_for_plan, check_no_overlap, prefill_events
    from geotrain.report.timeline import draw_timeline
    from geotrain.trace.metrics import trace_columns

    bt = bubbletea_for_plan(spec, res, cfg)
    check_no_overlap(res.trace, bt.result, cfg.fill_dp_reduction)   # prefill only in bubbles: training unchanged
    r = bt.result
    print()
    print(f"BubbleTea: prefill of {bt.inference_model} in the bubbles "
          f"({len(bt.ranks_simulated)} representative GPUs serve a proportional share of the stream)")
    rows = [list(x) for x in r.summary_rows()]
    rows.append(["training actions moved", "none (prefill only inside predicted bubbles)"])
    rows.append(["inference models that fit beside training", ", ".join(bt.models_that_fit) or "none"])
    if bt.ranks_without_room:
        rows.append(["GPUs without room for the inference model", str(len(bt.ranks_without_room))])
    print(format_table(["BubbleTea", "value"], rows))
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
