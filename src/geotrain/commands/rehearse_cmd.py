"""geotrain rehearse SPEC_OR_PLAN: a multi-host deployment rehearsed on one machine (root)."""

from __future__ import annotations

import argparse

from geotrain.errors import GeotrainError
from geotrain.orchestrate.rehearse_run import rehearse

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
    p.add_argument("--no-progress", action="store_true",
                   help="the hosts train with --no-progress: no progress bars or summary, no curves.png")
    p.add_argument("--serve-prefill", type=int, default=None, metavar="PORT",
                   help="not available: BubbleTea's service needs geotrain's own launcher (refused in one line)")


def run(args: argparse.Namespace) -> int:
    if args.serve_prefill is not None:
        raise GeotrainError("--serve-prefill is not available under rehearse: each host runs torchrun, and "
                            "BubbleTea's service needs geotrain's own launcher (geotrain train --serve-prefill)")
    same = rehearse(args.spec, out=args.out, steps=args.steps, data=args.data, compare=args.compare,
                    compare_with=args.compare_with, rate_scale=args.wan_rate_scale, tls=args.wan_tls,
                    timeout_s=args.timeout, progress=not args.no_progress, say=lambda line: print(line, flush=True))
    return 0 if same else 1
