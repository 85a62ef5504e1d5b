"""Benchmark: time from losing a datacenter to the first resumed step, by phase.

    sudo .venv/bin/python bench/bench_elastic.py [--spec examples/tiny_2dc.toml] [--cut west:4]
         [--steps 8] [--checkpoint-every 2] [--repeat 2] [--wan auto]

Each repetition is one `geotrain train SPEC --elastic --cut-dc DC:STEP` run: once STEP is logged
the launcher SIGKILLs that DC's ranks (a lost DC, seen from the survivors); the run re-plans
without it and resumes its last checkpoint on the rest. The phases come from the run's own
wall-clock stamps (RUN_DIR/elastic.jsonl and the resumed step's `resume_wall` in losses.jsonl):

  detection   the kill -> the launcher has the RankFailure (its poll, the 0.3 s it gives the
              failing rank's peers to report, then stopping every other rank)
  re-plan     the planner on the cluster left, plus simulating the plans before and after
  restart     new processes (one per rank of the new plan), the WAN for it, process group,
              model and optimizer built -- up to the start of the checkpoint load
  load        DCP load of the checkpoint into the new layout (resharded), optimizer included
  first step  the first resumed optimizer step
  total       the kill -> the end of the first resumed step

Also printed: how many steps past the checkpoint were lost (recomputed). Numbers on a shared
2-core machine are noisy; each row is one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("detection", "re-plan", "restart", "load", "first step", "total")


def one_run(args, run: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "geotrain.cli", "train", args.spec, "--elastic", "--cut-dc", args.cut,
           "--steps", str(args.steps), "--checkpoint-every", str(args.checkpoint_every), "--data", "synthetic",
           "--precision", "fp32", "--wan", args.wan, "--out", str(run), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    event = json.loads((run / "elastic.jsonl").read_text().splitlines()[0])
    rows = [json.loads(x) for x in (run / "losses.jsonl").read_text().splitlines()]
    resumed = next(r for r in rows if "resumed_from" in r)["resume_wall"]
    w = event["wall"]
    return {"detection": w["detected"] - w["cut"], "re-plan": w["replanned"] - w["detected"],
            "restart": resumed["load_start"] - w["replanned"], "load": resumed["load_end"] - resumed["load_start"],
            "first step": resumed["step_end"] - resumed["step_start"], "total": resumed["step_end"] - w["cut"],
            "lost steps": len(event["lost_losses"]),
            "layout": f"pp{event['before']['pp']}xdp{event['before']['dp']} -> "
                      f"pp{event['after']['pp']}xdp{event['after']['dp']}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(ROOT / "examples" / "tiny_2dc.toml"))
    ap.add_argument("--cut", default="west:4", metavar="DC:STEP")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--wan", default="auto", choices=["auto", "kernel", "shaper", "off"])
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        for i in range(args.repeat):
            rows.append(one_run(args, Path(tmp) / f"run{i}"))
    print(f"failure -> first resumed step ({args.spec}, cut {args.cut}, --wan {args.wan}); seconds, one row per run")
    print("  " + "".join(f"{p:>12}" for p in PHASES) + f"{'lost steps':>12}  layout")
    for r in rows:
        print("  " + "".join(f"{r[p]:>12.2f}" for p in PHASES) + f"{r['lost steps']:>12}  {r['layout']}")
    if len(rows) > 1:
        print("  " + "".join(f"{statistics.median(r[p] for r in rows):>12.2f}" for p in PHASES) + "  (median)")


if __name__ == "__main__":
    main()
