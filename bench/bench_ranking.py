"""Ranking (issue #26 item 3): pairs of plans the planner must order, run interleaved on this machine.

    .venv/bin/python bench/bench_ranking.py [--rounds 5] [--profile FILE] [--out DIR] [--write-docs]   # as root

Profiles the machine once (kernel WAN; or --profile), predicts both arms of every pair of
calibrate.ranking.PAIRS from that profile, then runs the arms over the kernel-emulated WAN in the
order A B A B ... (--rounds times each) and prints the predicted ratio beside the ratio of the
measured medians. --write-docs puts the table in docs/VALIDATION.md section 3.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
BEGIN, END = "<!-- ranking-results -->", "<!-- /ranking-results -->"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="/tmp/geotrain-ranking", metavar="DIR")
    ap.add_argument("--profile", metavar="FILE", help="use this (kernel-WAN) profile instead of measuring one")
    ap.add_argument("--pairs", default=None, help="comma-separated pair indices (default: all)")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    from _doc_sections import replace_section
    if args.rounds < 1 or args.warmup < 0 or args.steps <= args.warmup:
        print("error: --rounds >= 1 and --steps > --warmup >= 0", file=sys.stderr)
        return 2

    from geotrain.calibrate.cases import CASES, write_spec
    from geotrain.calibrate.measure import measure_profile
    from geotrain.calibrate.profile_file import load_profile, save_profile
    from geotrain.calibrate.ranking import PAIRS, ranking
    from geotrain.errors import GeotrainError

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        if args.profile:
            profile = load_profile(args.profile)
        else:
            print("profiling this machine (kernel WAN) ...", flush=True)
            profile = measure_profile(write_spec(CASES[0], out / "_profile_spec"), mode="kernel")
            save_profile(profile, out / "profile-kernel.json")
        pairs = [PAIRS[int(i)] for i in args.pairs.split(",")] if args.pairs else PAIRS
        _, md = ranking(out, profile, rounds=args.rounds, steps=args.steps, warmup=args.warmup, pairs=pairs)
    except (GeotrainError, ValueError, IndexError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(md)
    if args.write_docs:
        stamp = time.strftime("%Y-%m-%d %H:%M")
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        cmd = f".venv/bin/python bench/bench_ranking.py --rounds {args.rounds} --steps {args.steps} " \
              f"--warmup {args.warmup}" + (f" --pairs {args.pairs}" if args.pairs else "")
        body = (f"Measured {stamp} with `{cmd} --write-docs` ({time.time() - t0:.0f} s with the profile; load "
                f"average at the end {load}):\n\n{md}")
        replace_section(ROOT / "docs" / "VALIDATION.md", BEGIN, END, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
