"""geotrain wan up|down|status SPEC: the emulated datacenters and WAN, for manual use.

`up` builds the namespaces for the spec's cluster (a cluster file or an experiment file) and leaves
them running (until `down`, or --lifetime seconds, after which the delayer tears them down);
`status` lists every emulation this machine has (or the spec's); `down` removes the spec's (or all
with --all), including stale ones left by a crashed run.
"""

from __future__ import annotations

import argparse
import sys

from geotrain.emulation import netns as N
from geotrain.errors import GeotrainError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("spec", nargs="?", metavar="SPEC", help="cluster or experiment TOML file")
    p.add_argument("--lifetime", type=float, default=3600.0, help="seconds before `up` tears itself down")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply every link rate (delayer ~1-2 Gbit/s)")
    p.add_argument("--all", action="store_true", help="with `down`: remove every geotrain emulation")


def _cluster(path: str):
    # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.spec import load_cluster, load_spec
    from geotrain.spec.load import _read_toml

    data = _read_toml(__import__("pathlib").Path(path))
    return load_spec(path).cluster if "job" in data else load_cluster(path)


def run(args: argparse.Namespace) -> int:
    # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.emulation.network import WanEmulation, cluster_tag, emulation_available

    try:
        if args.action == "status":
            states = N.all_states()
            if args.spec:
                tag = cluster_tag(_cluster(args.spec), unique=False)
                states = [s for s in states if s.tag == tag]
            if not states:
                print("no WAN emulation is running")
            present = N.existing_namespaces()
            for st in states:
                alive = st.delayer_pid is not None and N.process_alive(st.delayer_pid)
                ok = alive and set(st.all_namespaces()) <= present
                owner = "manual (geotrain wan up)" if st.owner_pid is None else f"process {st.owner_pid}"
                print(f"{st.tag}: {'up' if ok else 'BROKEN'}; owner {owner}; delayer "
                      f"{'running' if alive else 'DEAD (WAN traffic is dropped)'}; stale: {not N.owner_alive(st)}")
                for dc, ns, i in zip(st.dcs, st.namespaces, range(len(st.dcs))):
                    print(f"  {dc}: ip netns exec {ns} ...   address {N.dc_address(i)}  interface {N.DC_IFNAME}")
            return 0
        if args.action == "down":
            states = N.all_states()
            if not args.all:
                if not args.spec:
                    raise GeotrainError("wan down needs SPEC or --all")
                tag = cluster_tag(_cluster(args.spec), unique=False)
                states = [s for s in states if s.tag == tag or not N.owner_alive(s)]
            for st in states:
                N.teardown(st)
                print(f"removed WAN emulation {st.tag} ({', '.join(st.dcs)})")
            if not states:
                print("nothing to remove")
            return 0
        if not args.spec:
            raise GeotrainError("wan up needs SPEC")
        ok, why = emulation_available()
        if not ok:
            raise GeotrainError(f"cannot emulate the WAN here ({why}); the runtime falls back to delay and "
                                f"rate limits inside its own transport")
        cluster = _cluster(args.spec)
        if not cluster.wan_links:
            raise GeotrainError(f"{args.spec}: the cluster has no WAN links to emulate")
        w = WanEmulation(cluster, manual=True, lifetime_s=args.lifetime, rate_scale=args.rate_scale)
        w.start()
        w.detach()
        print(w.describe())
        print(f"run a command in a DC: ip netns exec {w.state.namespaces[0]} CMD; "
              f"remove: geotrain wan down {args.spec}")
        return 0
    except GeotrainError as e:
        print(f"geotrain wan: error: {e}", file=sys.stderr)
        return e.exit_code
