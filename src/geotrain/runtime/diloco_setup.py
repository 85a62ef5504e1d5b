"""Build a rank's DiLoCo part (runtime.diloco) from its run config: the outer store's clients, the
outer transport (StripedTransport: the plan's connections per peer, the run's secret shared by
every worker, the emulated WAN's instruments where there is one), the OuterGroup and DiLoCo.

Identities: the outer transport of rank i of worker w (incarnation n) is
`OuterGroup.ident` = (n W + w) R + i, R the ranks of one worker; its DC is the one the plan puts
that rank in, in that worker.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from geotrain.emulation.fallback import fallback_shaper
from geotrain.emulation.ports import spread_port_connections
from geotrain.errors import GeotrainError
from geotrain.runtime.cross_dc import RecordedTurns
from geotrain.runtime.diloco import DiLoCo
from geotrain.runtime.outer_group import OuterGroup
from geotrain.runtime.outer_store import connect
from geotrain.transport.auth import read_secret_file, run_secret
from geotrain.transport.striped import StripedTransport
from geotrain.transport.turns import link_handoff, turn_slots, turns_via_store

DEFAULT_DEAD_AFTER_S = 30.0


def named_parameters(chunks) -> list[tuple[str, Any]]:
    """This rank's parameters by the model's plain names (as the checkpoint keys them), chunk by chunk."""
    return [(name, p) for _v, m in sorted(chunks.items()) for name, p in m.named_parameters()]


def build_diloco(cfg, spec, plan, me, recorder) -> DiLoCo | None:
    """The rank's DiLoCo, or None for a plan without workers."""
    if plan.outer is None:
        return None
    o = plan.outer
    replicated = plan.dp if plan.sharding in ("replicate", "zero1") else 1
    named = named_parameters(me.chunks)
    if o.num_workers == 1:
        return DiLoCo(o, named, None, replicated, me.replica, me.dp_group, recorder)
    d = cfg.diloco
    if d is None or not d.store:
        raise GeotrainError(f"plan {plan.name!r} trains {o.num_workers} DiLoCo workers, but this rank was not told "
                            "where they meet (start it with `geotrain train`, which launches every worker)")
    R, W = plan.num_ranks, o.num_workers
    wan = cfg.wan
    my_dc = plan.dc_of_rank(me.rank)
    host = wan.hosts[my_dc] if wan.mode == "kernel" else d.bind or wan.bind or "127.0.0.1"
    full = plan.with_(worker=0)

    def dc_of(ident: int) -> str:
        return full.worker_plan((ident // R) % W).dc_of_rank(ident % R)

    hooks: dict[str, Any] = {}
    if wan.mode == "shaper":
        hooks["shaper"] = fallback_shaper(spec.cluster, dc_of, my_dc, wan.rate_scale)
    elif wan.mode == "kernel":     # buckets past the pipeline transports' (rank * their stride)
        hooks["connect"] = functools.partial(spread_port_connections, first_bucket=(R + me.rank) * o.connections)
    timeout = wan.outage_limit_s
    params = sum(p.numel() for _, p in named)

    turns: dict[int, object] = {}       # per other worker: this link direction's turns, where they are taken

    def transport(ident: int) -> StripedTransport:
        turns.update(_outer_turns(spec, plan, me, store, secret, host, wan, recorder, ident // R // W))
        return StripedTransport(ident, store, secret=secret, host=host, connections=o.connections,
                                turns=lambda dst: turns.get((dst // R) % W),
                                prefix=f"geotrain/outer/r{me.rank}/striped", min_chunk_bytes=4096, timeout_s=timeout,
                                max_message_bytes=4 * params + 4096, tls=wan.tls,
                                describe=lambda r: f"worker {(r // R) % W} rank {r % R} ({dc_of(r)})", **hooks)

    store, beats = connect(d.store), connect(d.store)
    # the launcher's 0600 file for the workers; under torchrun the run's (GEOTRAIN_SECRET_FILE), else the store's
    secret = read_secret_file(Path(d.secret_file)) if d.secret_file else run_secret(store)
    group = OuterGroup(store, beats, transport, worker=plan.worker, workers=W, inner_rank=me.rank, inner_ranks=R,
                       dead_after_s=d.dead_after_s or DEFAULT_DEAD_AFTER_S, incarnation=d.incarnation,
                       rejoin_wait_s=d.rejoin_wait_s)
    group.also_close += [t for t in turns.values() if hasattr(t, "close")]
    dl = DiLoCo(o, named, group, replicated, me.replica, me.dp_group, recorder, link=f"{my_dc}->workers")
    dl.joining = group.incarnation > 0
    return dl


def _outer_turns(spec, plan, me, store, secret, host, wan, recorder, incarnation: int) -> dict[int, object]:
    """{other worker: turns} for the link directions this rank's outer transfers share with other
    ranks of its worker, where the plan's outer sharing is temporal and fewer transfers than those
    ranks fill the link (transport.turns.turn_slots): one ring of turns per (worker, direction)."""
    o = plan.outer
    if o.sharing != "temporal":
        return {}
    R, w = plan.num_ranks, plan.worker
    mine = [plan.worker_plan(w).dc_of_rank(i) for i in range(R)]
    out: dict[int, object] = {}
    scale, timeout = wan.rate_scale, wan.outage_limit_s
    for w2 in range(o.num_workers):
        theirs = [plan.worker_plan(w2).dc_of_rank(i) for i in range(R)]
        a, b = mine[me.rank], theirs[me.rank]
        link = spec.cluster.link(a, b) if a != b else None
        if w2 == w or link is None:
            continue
        sharing = [i for i in range(R) if mine[i] == a and theirs[i] == b]
        slots = turn_slots("temporal", link.capacity_gbps, link.rate_gbps(o.connections), len(sharing))
        if not slots:
            continue
        handoff = link_handoff(link.capacity_gbps * scale, link.rate_gbps(o.connections) * scale, link.latency_ms,
                               slots)
        order = list(range(len(sharing)))
        turn, arbiter = turns_via_store(store, f"outer/{w}.{incarnation}->{w2}/{a}->{b}", sharing.index(me.rank),
                                        order, host=host, is_host=sharing.index(me.rank) == 0, timeout_s=timeout,
                                        slots=slots, secret=secret, handoff=handoff)
        out[w2] = RecordedTurns(turn, recorder, f"{a}->{b}", -1)
        if arbiter is not None:
            out[-1 - w2] = arbiter          # kept to be closed with the group
    return out
