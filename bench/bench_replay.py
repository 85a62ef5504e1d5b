"""Trace replay of the CPU validation set (issue #26 item 2): the network and schedule model alone.

    .venv/bin/python bench/bench_replay.py [--runs 3] [--out DIR] [--write-docs]   # runs the set (kernel WAN, root)
    .venv/bin/python bench/bench_replay.py --from DIR [--write-docs]              # replays a stored set again

Runs every case of calibrate.cases over the kernel-emulated WAN (as bench/bench_validate_sim.py does,
its prediction made before each run), then replays each run: the simulator with the run's own
measured compute durations, per op and per rank, and everything else -- WAN transfers, turns,
collectives, schedule, waits -- from the profile's model (calibrate.replay). Prints iteration and
per-rank bubble time, replayed vs measured. A replay is not a prediction. --from DIR replays the runs
stored in a validation directory (its profile-kernel.json, run<k>/kernel/<case>/) without running
anything; --write-docs puts the tables in docs/VALIDATION.md section 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
BEGIN, END = "<!-- replay-results -->", "<!-- /replay-results -->"


def replay_stored(out: Path, mode: str = "kernel") -> list[dict]:
    """The runs of a stored validation directory with each case's replay recomputed."""
    from geotrain.calibrate.case_rows import CaseRow, bubble_per_rank
    from geotrain.calibrate.cases import CASES, case_plan
    from geotrain.calibrate.profile_file import load_profile
    from geotrain.calibrate.replay import replay_run
    from geotrain.spec.load import load_spec
    from geotrain.trace.schema import Trace

    results = json.loads((out / "results.json").read_text())
    profile = load_profile(out / f"profile-{mode}.json")
    warmup = results["conditions"]["warmup"]
    keep = set(CaseRow.__dataclass_fields__)
    cases = {c.name: c for c in CASES}
    runs = []
    for k, run in enumerate(results["runs"], 1):
        if mode not in run:
            continue
        rows = []
        for d in run[mode]["rows"]:
            row = CaseRow(**{f: v for f, v in d.items() if f in keep})
            for f in ("predicted_busy", "measured_busy", "predicted_bubble_rank", "measured_bubble_rank",
                      "replay_bubble_rank"):
                setattr(row, f, {int(r): v for r, v in getattr(row, f).items()})
            case_dir = out / f"run{k}" / mode / row.case
            spec = load_spec(case_dir / "spec.toml")
            measured = Trace.read_jsonl(case_dir / "run" / "measured_trace.jsonl")
            slow = {int(r): v for r, v in (run[mode]["details"][row.case].get("rank_slowdown") or {}).items()}
            rep = replay_run(spec, case_plan(spec, cases[row.case]), profile, measured, warmup, mode=mode,
                             rank_slowdown=slow or None)
            row.replay_iteration_s, row.replay_bubble_rank = rep.metrics.iteration_time, bubble_per_rank(rep.metrics)
            rows.append(row)
        runs.append({mode: {"rows": rows, "details": run[mode]["details"]}})
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="/tmp/geotrain-replay", metavar="DIR")
    ap.add_argument("--from", dest="stored", metavar="DIR", help="replay the runs stored in this validation directory")
    ap.add_argument("--profile", metavar="FILE", help="use this profile instead of measuring one")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    from _doc_sections import replace_section

    from geotrain.calibrate.profile_file import load_profile
    from geotrain.calibrate.tables import replay_markdown
    from geotrain.calibrate.validation import run_validation
    from geotrain.errors import GeotrainError

    t0 = time.time()
    try:
        if args.stored:
            out = Path(args.stored)
            runs = replay_stored(out)
            cmd = f".venv/bin/python bench/bench_replay.py --from {out}"
        else:
            out = Path(args.out)
            results, _ = run_validation(out, profile=load_profile(args.profile) if args.profile else None,
                                        steps=args.steps, warmup=args.warmup, modes=("kernel",), runs=args.runs,
                                        only=args.cases.split(",") if args.cases else None)
            runs = replay_stored(out)       # the same replays run_case made, read back through one path
            cmd = (f".venv/bin/python bench/bench_replay.py --runs {args.runs} --steps {args.steps} "
                   f"--warmup {args.warmup}")
    except (GeotrainError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    md = replay_markdown(runs, "kernel")
    print(md)
    if args.write_docs:
        stamp = time.strftime("%Y-%m-%d %H:%M")
        load = Path("/proc/loadavg").read_text().split()[:3]
        body = (f"Measured {stamp} with `{cmd} --write-docs` ({time.time() - t0:.0f} s; load average at the end "
                f"{' '.join(load)}):\n\n{md}")
        replace_section(ROOT / "docs" / "VALIDATION.md", BEGIN, END, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
