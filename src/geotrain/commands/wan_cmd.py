"""geotrain wan up|down|status SPEC: the emulated datacenters and WAN, for manual use.

`up` builds the namespaces for the spec's cluster (a cluster file or an experiment file) and leaves
them running (until `down`, or --lifetime seconds, after which the delayer tears them down);
`status` lists every emulation this machine has (or the spec's); `down` removes the spec's (or all
with --all), including stale ones left by a crashed run.
"""

from __future__ import annotations

import argparse

from geotrain.emulation.wan_manual import wan_action


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("spec", nargs="?", metavar="SPEC", help="cluster or experiment TOML file")
    p.add_argument("--lifetime", type=float, default=3600.0, help="seconds before `up` tears itself down")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply every link rate (delayer ~1-2 Gbit/s)")
    p.add_argument("--all", action="store_true", help="with `down`: remove every geotrain emulation")


def run(args: argparse.Namespace) -> int:
    wan_action(args.action, args.spec, all_dcs=args.all, lifetime=args.lifetime, rate_scale=args.rate_scale)
    return 0
