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
from geotrain.runtime.diloco import DiLoCo
from geotrain.runtime.outer_group import OuterGroup
from geotrain.runtime.outer_store import connect
from geotrain.transport.auth import read_secret_file, run_secret
from geotrain.transport.striped import StripedTransport

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

    def transport(ident: int) -> StripedTransport:
        return StripedTransport(ident, store, secret=secret, host=host, connections=o.connections,
                                prefix=f"geotrain/outer/r{me.rank}/striped", min_chunk_bytes=4096, timeout_s=timeout,
                                max_message_bytes=4 * params + 4096, tls=wan.tls,
                                describe=lambda r: f"worker {(r // R) % W} rank {r % R} ({dc_of(r)})", **hooks)

    store, beats = connect(d.store), connect(d.store)
    # the launcher's 0600 file for the workers; under torchrun the run's (GEOTRAIN_SECRET_FILE), else the store's
    secret = read_secret_file(Path(d.secret_file)) if d.secret_file else run_secret(store)
    group = OuterGroup(store, beats, transport, worker=plan.worker, workers=W, inner_rank=me.rank, inner_ranks=R,
                       dead_after_s=d.dead_after_s or DEFAULT_DEAD_AFTER_S, incarnation=d.incarnation)
    return DiLoCo(o, named, group, replicated, me.replica, me.dp_group, recorder, link=f"{my_dc}->workers")
