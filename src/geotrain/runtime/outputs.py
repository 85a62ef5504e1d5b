"""End of a run: write the measured trace and a where-the-time-went summary.

(The simulator's prediction beside it is written by the caller, `calibrate.predict`: the
runtime executes and measures, it does not simulate. It does set the cost model's peak memory per
stage -- the number the plan's fit was checked with, a lookup -- beside the peak it measured.)

Per-rank time totals travel as one tensor all-reduce (a row per rank). The trace does not travel: each
rank streamed its own file into its host's RUN_DIR/trace (runtime.recorder), and the reporting rank (the
one that owns the loss) merges the files its host has -- every rank's on one host or a shared filesystem;
else it says which are elsewhere, and `geotrain report` merges them once copied (trace.merge).
"""

from __future__ import annotations

import os
import resource
import socket
import struct
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geotrain.console import human_bytes, number_runs
from geotrain.errors import GeotrainError
from geotrain.layout.peaks import predicted_stage_peaks
from geotrain.runtime.cross_dc import bind_address
from geotrain.runtime.recorder import Recorder
from geotrain.trace.chrome import write_chrome
from geotrain.trace.merge import merge_rank_files
from geotrain.trace.schema import json_text

COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
COLUMNS = ("compute", "waiting", "allreduce", "optimizer", "wall", "optimizer_steps",
           "params_bytes", "grads_bytes", "optimizer_bytes", "max_rss_bytes", "peak_bytes", "ipv4")


def write_outputs(cfg, spec, plan, schedule, recorder: Recorder, out: Path, wall: float, steps_run: int,
                  tokens_per_step: int, optimizer_steps: int = 0,
                  memory: dict[str, int] | None = None, reporter: int = 0,
                  losses: list[dict] | None = None) -> dict[str, Any]:
    """Every rank: its trace file and its row of totals; the reporting rank: the merged trace, the
    summary. `schedule` is the run's (for the predicted peaks); `losses` the rows the reporting rank
    wrote to losses.jsonl, handed on rather than read back. The reporting rank returns the losses,
    the summary and the merged trace (for a caller in this process: no need to read the files)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    recorder.close()                   # this rank's trace file is complete (RUN_DIR/trace/rank<R>.jsonl)
    tot = recorder.totals()
    row = torch.zeros(world, len(COLUMNS), dtype=torch.float64)
    row[rank] = torch.tensor([sum(tot.get(k, 0.0) for k in COMPUTE), tot.get("recv_wait", 0.0),
                              tot.get("allreduce", 0.0), tot.get("optimizer", 0.0), wall, optimizer_steps,
                              *(float((memory or {}).get(k, 0)) for k in ("params", "grads", "optimizer")),
                              _max_rss(), float((memory or {}).get("peak", 0)), float(_my_ipv4())],
                             dtype=torch.float64)
    dist.all_reduce(row)               # a CPU tensor: gloo, also on CUDA ranks ("cpu:gloo,cuda:nccl")
    dist.barrier()
    if rank != reporter:
        return {}
    meta = {"plan": plan.name, "schedule": plan.schedule, "pp": plan.pp, "dp": plan.dp, "tp": plan.tp,
            "precision": plan.precision, "checkpointing": plan.checkpointing, "sharding": plan.sharding,
            "tokens_per_iteration": tokens_per_step,
            # Where it ran: ranks sharing CPU cores measure differently from dedicated GPUs (report.compare).
            "device": "cuda" if torch.cuda.is_available() else "cpu", "cores": os.cpu_count() or 1}
    merged = None
    if cfg.trace:        # the files on this host (all of them on one host or a shared filesystem)
        merged = merge_rank_files(out / "trace", out / "measured_trace.jsonl", world, meta)
        write_chrome(merged, out / "measured_trace.chrome.json", plan)     # for ui.perfetto.dev / chrome://tracing
        missing = merged.meta.get("ranks_missing")
        if missing and cfg.progress:
            print(f"trace: ranks {number_runs(missing)} wrote theirs on their own hosts (RUN_DIR/trace/rank<R>.jsonl "
                  f"there); copy them into {out / 'trace'} and run `geotrain report {out}` to merge them", flush=True)
    losses = list(losses or [])
    per_stage = {}
    for s in range(plan.pp):
        rows = row[[plan.rank(s, r) for r in range(plan.dp)]].mean(0)
        w = max(float(rows[4]), 1e-9)
        per_stage[s] = {c: float(rows[i]) / w for i, c in enumerate(COLUMNS[:4])}
        per_stage[s]["other"] = max(0.0, 1.0 - sum(per_stage[s].values()))
    summary = {"steps": steps_run, "wall_s": wall, "tokens_per_s": tokens_per_step * steps_run / max(wall, 1e-9),
               "final_loss": losses[-1]["loss"] if losses else None,
               "skipped_steps": sum(1 for x in losses if x.get("skipped")),
               "optimizer_steps_per_rank": [int(x) for x in row[:, 5].tolist()],
               "memory_per_rank": [{"params": int(r[6]), "grads": int(r[7]), "optimizer": int(r[8]),
                                    "max_rss": int(r[9]), "peak": int(r[10])} for r in row.tolist()],
               "time_fractions": per_stage,
               # Where each rank ran, as its own network stack says (not the plan): one address per host
               # (per emulated DC's namespace), e.g. to check the ranks of a DC ran in that DC.
               "address_per_rank": [socket.inet_ntoa(struct.pack("!I", int(x))) for x in row[:, 11].tolist()],
               "memory_per_stage": _memory_per_stage(spec, plan, schedule, row[:, 10].tolist())}
    (out / "summary.json").write_text(json_text(summary, indent=2) + "\n")
    if cfg.progress:
        print(format_summary(summary, out), file=sys.stdout, flush=True)
    return {"losses": losses, "summary": summary, "trace": merged}


def _memory_per_stage(spec, plan, schedule, peaks: list[float]) -> list[dict[str, Any]]:
    """Predicted (cost model, this plan's schedule) against measured (runtime.measured_memory.StepPeak, the
    largest over the stage's ranks) peak bytes of one steady-state step, per stage."""
    predicted = predicted_stage_peaks(spec, plan, schedule)
    out = []
    for s, pred in enumerate(predicted):
        ranks = [plan.rank(s, r, t) for r in range(plan.dp) for t in range(plan.stage_tp(s))]
        measured = max(peaks[r] for r in ranks)
        out.append({"stage": s, "predicted_peak": pred.total, "measured_peak": measured,
                    "error": pred.total / measured - 1 if measured else None,
                    "predicted": {k: getattr(pred, k) for k in ("params", "grads", "optimizer", "activations",
                                                                "transient", "buffers", "data")}})
    return out


def _my_ipv4() -> int:
    """This host's address towards the rendezvous (runtime.cross_dc.bind_address) as an integer, so it
    rides in the float64 row (exact below 2**53); 0 where none can be told."""
    try:
        return struct.unpack("!I", socket.inet_aton(bind_address()))[0]
    except (GeotrainError, OSError):
        return 0


def _max_rss() -> float:
    """Peak resident memory of this process (bytes; Linux reports KiB)."""
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def format_summary(summary: dict[str, Any], out: Path) -> str:
    lines = [f"trained {summary['steps']} steps in {summary['wall_s']:.1f} s "
             f"({summary['tokens_per_s']:,.0f} tokens/s), final loss {summary['final_loss']:.4f}"
             + (f", {summary['skipped_steps']} skipped (fp16 overflow)" if summary["skipped_steps"] else ""),
             "where the time went (share of wall time, mean over the stage's replicas):",
             "  stage  compute  waiting  all-reduce  optimizer  other"]
    for s, f in summary["time_fractions"].items():
        lines.append(f"  {s:>5}  {f['compute']:>7.0%}  {f['waiting']:>7.0%}  {f['allreduce']:>10.0%}  "
                     f"{f['optimizer']:>9.0%}  {f['other']:>5.0%}")
    mem = summary.get("memory_per_stage") or []
    if mem and any(m["measured_peak"] for m in mem):
        lines.append("peak memory per GPU of one step (predicted by the cost model / measured):")
        for m in mem:
            err = f"{m['error']:+.0%}" if m["error"] is not None else "-"
            lines.append(f"  stage {m['stage']}: {human_bytes(m['predicted_peak'])} / {human_bytes(m['measured_peak'])}"
                         f"  ({err})")
    hosts: dict[str, list[int]] = {}
    for r, a in enumerate(summary.get("address_per_rank") or []):
        hosts.setdefault(a, []).append(r)
    if len(hosts) > 1:
        lines.append("ranks per host address: " + "; ".join(f"{a} ranks {number_runs(rs)}" for a, rs in hosts.items()))
    lines.append(f"run directory: {out}  (measured_trace.jsonl, losses.jsonl; see `geotrain report {out}`)")
    return "\n".join(lines)
