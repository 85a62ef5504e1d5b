"""`geotrain wan up|down|status`: the emulated datacenters and WAN, brought up and down by hand.

`up` builds the namespaces for a spec's cluster (a cluster file or an experiment file) and leaves
them running (until `down`, or `lifetime` seconds, after which the delayer tears them down);
`status` lists every emulation this machine has (or the spec's); `down` removes the spec's (or
all), including stale ones left by a crashed run.
"""

from __future__ import annotations

from pathlib import Path

from geotrain.emulation import netns as N
from geotrain.emulation.network import WanEmulation, cluster_tag, emulation_available
from geotrain.errors import GeotrainError
from geotrain.spec import load_cluster, load_spec
from geotrain.spec.load import _read_toml


def _cluster(path: str):
    data = _read_toml(Path(path))
    return load_spec(path).cluster if "job" in data else load_cluster(path)


def wan_action(action: str, spec: str | None = None, all_dcs: bool = False, lifetime: float = 3600.0,
               rate_scale: float = 1.0, say=print) -> None:
    """Do `action` (up, down, status) for `spec`'s cluster; see the module docstring."""
    if action == "status":
        states = N.all_states()
        if spec:
            tag = cluster_tag(_cluster(spec), unique=False)
            states = [s for s in states if s.tag == tag]
        if not states:
            say("no WAN emulation is running")
        present = N.existing_namespaces()
        for st in states:
            alive = st.delayer_pid is not None and N.process_alive(st.delayer_pid)
            ok = alive and set(st.all_namespaces()) <= present
            owner = "manual (geotrain wan up)" if st.owner_pid is None else f"process {st.owner_pid}"
            say(f"{st.tag}: {'up' if ok else 'BROKEN'}; owner {owner}; delayer "
                f"{'running' if alive else 'DEAD (WAN traffic is dropped)'}; stale: {not N.owner_alive(st)}")
            for dc, ns, i in zip(st.dcs, st.namespaces, range(len(st.dcs))):
                say(f"  {dc}: ip netns exec {ns} ...   address {N.dc_address(i)}  interface {N.DC_IFNAME}")
        return
    if action == "down":
        states = N.all_states()
        if not all_dcs:
            if not spec:
                raise GeotrainError("wan down needs SPEC or --all")
            tag = cluster_tag(_cluster(spec), unique=False)
            states = [s for s in states if s.tag == tag or not N.owner_alive(s)]
        for st in states:
            N.teardown(st)
            say(f"removed WAN emulation {st.tag} ({', '.join(st.dcs)})")
        if not states:
            say("nothing to remove")
        return
    if not spec:
        raise GeotrainError("wan up needs SPEC")
    ok, why = emulation_available()
    if not ok:
        raise GeotrainError(f"cannot emulate the WAN here ({why}); the runtime falls back to delay and "
                            f"rate limits inside its own transport")
    cluster = _cluster(spec)
    if not cluster.wan_links:
        raise GeotrainError(f"{spec}: the cluster has no WAN links to emulate")
    w = WanEmulation(cluster, manual=True, lifetime_s=lifetime, rate_scale=rate_scale)
    w.start()
    w.detach()
    say(w.describe())
    say(f"run a command in a DC: ip netns exec {w.state.namespaces[0]} CMD; "
        f"remove: geotrain wan down {spec}")
    return
