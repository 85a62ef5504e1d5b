"""geotrain demo: the whole story on the built-in default, in a few minutes on a laptop-class CPU
(`orchestrate.demo_run`: plan, simulate, profile, train with BubbleTea, report)."""

from __future__ import annotations

import argparse

from geotrain.orchestrate.demo_run import DEFAULT_SPEC, SERVED_MODEL, demo

__all__ = ["SERVED_MODEL", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", default=None, metavar="SPEC",
                   help=f"experiment spec (default: the built-in {DEFAULT_SPEC})")
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="where to write everything (runs/demo)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the spec's)")
    p.add_argument("--requests", type=int, default=6, help="prompts to send while training (6)")
    p.add_argument("--no-profile", action="store_true",
                   help="skip measuring this machine (faster; the prediction is then the uncalibrated cost model's)")
    p.add_argument("--wan", default="auto", choices=["auto", "kernel", "shaper", "off"],
                   help="WAN emulation for training: auto, kernel, shaper, off")
    p.add_argument("--cut-dc", default=None, metavar="DC:STEP",
                   help="lose datacenter DC after step STEP (its ranks killed): training re-plans without it and "
                        "resumes from the last checkpoint on the rest (train --elastic, checkpoints every 2 steps)")


def run(args: argparse.Namespace) -> int:
    demo(args.spec, out=args.out, steps=args.steps, requests=args.requests, profile=not args.no_profile,
         wan=args.wan, cut_dc=args.cut_dc, say=lambda line: print(line, flush=True))
    return 0
