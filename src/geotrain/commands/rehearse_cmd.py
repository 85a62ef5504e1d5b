"""geotrain rehearse SPEC_OR_PLAN: a multi-host deployment rehearsed on one machine (root)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from geotrain.console import human_bytes, sent_received
from geotrain.trace.schema import json_text

DESCRIPTION = (
    "Bring the plan's datacenters up as network namespaces joined by the kernel-emulated WAN (root), start "
    "one torchrun per datacenter inside its namespace (c10d rendezvous across the WAN at the first "
    "datacenter's address, each host's WAN transport bound to its own address) and train the plan over the "
    "kernel WAN. Then say whether the losses equal the built-in launcher's run of the same plan, and per "
    "cross-DC link the connections (counted in the kernel), temporal turns and bytes measured. Writes "
    "RUN_DIR (the last stage's host: losses.jsonl, measured_trace.jsonl, ...), RUN_DIR/hosts/<dc>/ for the "
    "other hosts, RUN_DIR/logs/<dc>.log per torchrun, RUN_DIR/rehearse.json, and RUN_DIR/builtin/ for the "
    "comparison run."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC_OR_PLAN", help="experiment TOML or plan JSON")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: job.steps)")
    p.add_argument("--out", default=None, metavar="RUN_DIR", help="run directory (default: runs/<name>-rehearse)")
    p.add_argument("--data", default=None, help="text file or directory to train on, or 'synthetic' "
                   "(default: job.data, else the built-in corpus)")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                   help="also train the same plan with the built-in launcher (`geotrain train --wan auto`, into "
                        "RUN_DIR/builtin) and compare losses and step time (default: yes)")
    p.add_argument("--compare-with", default=None, metavar="RUN_DIR",
                   help="compare with this finished `geotrain train` run of the same plan instead of training one")
    p.add_argument("--wan-rate-scale", type=float, default=1.0, metavar="X",
                   help="multiply every WAN capacity and per-connection cap (as for `geotrain train`)")
    p.add_argument("--wan-tls", action="store_true",
                   help="cross-DC connections in TLS 1.3 (as `geotrain train --wan-tls`; the comparison run too)")
    p.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                   help="stop the rehearsal after S seconds (default 3600)")
    p.add_argument("--serve-prefill", type=int, default=None, metavar="PORT",
                   help="not available: BubbleTea's service needs geotrain's own launcher (refused in one line)")


def _plan(path: Path):
    # lazy: the command's heavy imports (torch, pydantic) load only when it runs (`geotrain --help` stays fast)
    from geotrain.layout.plan import load_plan, plan_spec

    if path.suffix == ".json":
        # lazy: as above
        from geotrain.layout.plan_check import check_plan_for_spec

        plan, doc = load_plan(path)
        spec = plan_spec(doc, path)
        check_plan_for_spec(spec, plan)       # before any host's ranks start
        return spec, plan, Path(doc.get("spec") or path).stem
    # lazy: the command's heavy imports (torch, pydantic) load only when it runs (`geotrain --help` stays fast)
    from geotrain.planner.confirm import make_plan
    from geotrain.spec import load_spec

    spec = load_spec(path)
    return spec, make_plan(spec).plan, path.stem


def _builtin(plan_path: Path, out: Path, train_args: list[str]) -> Path:
    """The built-in launcher's run of the same plan file, over the same kind of emulated WAN."""
    # lazy: the command's heavy imports (torch, pydantic) load only when it runs (`geotrain --help` stays fast)
    from geotrain.errors import GeotrainError

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


def run(args: argparse.Namespace) -> int:
    # lazy: the command's heavy imports (torch, pydantic) load only when it runs (`geotrain --help` stays fast)
    from geotrain.errors import GeotrainError
    from geotrain.layout.plan import save_plan
    from geotrain.layout.wan_bytes import predicted_link_bytes
    from geotrain.orchestrate.rehearsal import losses_of, median_step_s, run_rehearsal

    if args.serve_prefill is not None:
        raise GeotrainError("--serve-prefill is not available under rehearse: each host runs torchrun, and "
                            "BubbleTea's service needs geotrain's own launcher (geotrain train --serve-prefill)")
    if args.steps is not None and args.steps < 1:
        raise GeotrainError("--steps must be at least 1")
    if not args.timeout > 0:
        raise GeotrainError(f"--timeout must be a positive number of seconds (got {args.timeout})")
    if not args.wan_rate_scale > 0:
        raise GeotrainError("--wan-rate-scale must be positive")
    if args.compare_with and not (Path(args.compare_with) / "losses.jsonl").is_file():
        raise GeotrainError(f"--compare-with {args.compare_with}: no losses.jsonl there")
    spec, plan, name = _plan(Path(args.spec))
    out = Path(args.out or Path("runs") / f"{name}-rehearse")
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "rehearse_plan.json"          # one plan file: every host and the comparison train it
    save_plan(plan_path, plan, spec=spec)
    train_args = [*(["--steps", str(args.steps)] if args.steps else []), *(["--data", args.data] if args.data else []),
                  "--wan-rate-scale", str(args.wan_rate_scale), *(["--wan-tls"] if args.wan_tls else [])]
    result = run_rehearsal(spec, plan, plan_path, out, train_args, rate_scale=args.wan_rate_scale,
                           timeout_s=args.timeout, say=lambda line: print(line, flush=True))
    losses = losses_of(out)
    step = median_step_s(out)
    print(f"rehearsal: {len(losses)} steps in {result.wall_s:.1f} s wall, median step {step:.3f} s -> {out}")
    report = {"run_dir": str(out), "wall_s": result.wall_s, "median_step_s": step, "losses": losses,
              "links": result.links, "link_bytes": result.link_bytes}
    same = True
    other = None
    if args.compare_with:
        other = Path(args.compare_with)
    elif args.compare:
        print("comparison: the same plan with the built-in launcher (geotrain train --wan auto) ...", flush=True)
        other = _builtin(plan_path, out / "builtin", train_args)
    if other is not None:
        theirs = losses_of(other)
        same = losses == theirs
        their_step = median_step_s(other)
        report.update(compare_with=str(other), compare_losses=theirs, losses_identical=same,
                      compare_median_step_s=their_step)
        if same:
            print(f"losses: identical to the built-in launcher's run ({other}), all {len(losses)} steps bit for bit")
        else:
            diff = next((i for i, (a, b) in enumerate(zip(losses, theirs)) if a != b), min(len(losses), len(theirs)))
            print(f"losses: DIFFER from {other} at step {diff + 1} "
                  f"({losses[diff] if diff < len(losses) else '-'} vs {theirs[diff] if diff < len(theirs) else '-'})")
        if step and their_step:
            print(f"median step: rehearse {step:.3f} s vs built-in launcher {their_step:.3f} s "
                  f"(ratio {step / their_step:.2f})")
    if result.links:
        print("\n".join(_link_lines(result.links)))
    if result.link_bytes:
        print("WAN bytes (emulated links, whole run, the process group's collectives included): "
              + sent_received(result.link_bytes))
        import torch  # lazy, as above (the ranks run on this host: gloo without CUDA)

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        print(f"WAN bytes predicted (layout.wan_bytes, {len(losses)} iterations, {backend}): "
              + sent_received(predicted_link_bytes(spec, plan, len(losses), backend)))
    (out / "rehearse.json").write_text(json_text(report, indent=2) + "\n")
    return 0 if same else 1
