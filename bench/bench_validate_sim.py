"""Simulator validation: every case of geotrain.calibrate.cases run for real and simulated.

    .venv/bin/python bench/bench_validate_sim.py [--quick] [--out DIR] [--profile FILE] [--write-docs]

Profiles the machine first (unless --profile), then prints predicted vs measured iteration time,
per-rank busy fraction and bubble time for each case and the mean/worst iteration-time error.
With --write-docs the table also replaces the results section of docs/VALIDATION.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- results -->"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="/tmp/geotrain-validate-sim")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--wan", default="shaper", choices=["auto", "kernel", "shaper"])
    args = ap.parse_args()

    from geotrain.calibrate.profile import load_profile
    from geotrain.calibrate.validate import run_validation

    t0 = time.time()
    profile = load_profile(args.profile) if args.profile else None
    rows, md = run_validation(Path(args.out), quick=args.quick, profile=profile, steps=args.steps,
                              warmup=args.warmup, mode=args.wan)
    print()
    print(md)
    print(f"total {time.time() - t0:.0f} s")
    if args.write_docs:
        cmd = "`.venv/bin/python bench/bench_validate_sim.py" + (" --quick" if args.quick else "") + \
              f" --steps {args.steps} --warmup {args.warmup}" + \
              (f" --wan {args.wan}" if args.wan != "shaper" else "") + " --write-docs`"
        doc = ROOT / "docs" / "VALIDATION.md"
        head = doc.read_text().split(MARK)[0] if doc.exists() else ""
        stamp = time.strftime("%Y-%m-%d %H:%M")
        doc.write_text(head + MARK + f"\n\nMeasured {stamp} with {cmd}:\n\n" + md)
        print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
