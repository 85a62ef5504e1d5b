"""A runtime rank with the user-space WAN on its cross-DC transfers:
`python -m geotrain.calibrate.worker CONFIG.json` (started by wanrun.launch_with_wan).

The runtime builds its transport as `TorchTransport()` (gloo isend/irecv for every pair). This
worker replaces that factory, before the run starts, with `WanRouting`: pairs inside one DC keep
gloo; pairs in different DCs go through the WAN helper's `StripedTransport` with n connections, its
user-space shaper (per-connection and aggregate rate, one-way delay) and, for temporal sharing, a
turn arbiter per link direction. Then it runs the runtime's own worker main unchanged.

The WAN description comes from the file named by GEOTRAIN_WAN_CONFIG:
    {"rank_dc": ["east", "east", "west", "west"], "rank_replica": [0, 1, 0, 1],
     "links": {"east->west": {"per_connection_gbps", "aggregate_gbps", "delay_ms", "connections",
                              "sharing", "order": [0, 1]}, ...}}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_ORIGINAL = None     # the runtime's own TorchTransport, kept for intra-DC pairs
MIN_CHUNK_BYTES = 4096


def strict_reserve(self, nbytes: int, not_before: float) -> float:
    """Pacer.reserve as a link serializes: a block may leave only when its LAST byte would have left
    (no burst credit). The shaper's own version lets a block leave at the start of its slot with a
    128 KB burst, so a lone 32 KB message crossed a "10 Mbit/s" link in ~0 ms instead of 26 ms --
    fine for bulk rates, wrong for the per-message timing the simulator predicts."""
    with self.lock:
        tat = max(self.next, not_before)
        self.next = tat + nbytes / self.bytes_per_s
        return self.next


class WanRouting:
    """Transport contract: gloo inside a DC, the shaped striped transport across DCs."""

    def __init__(self, group=None):
        import torch.distributed as dist

        from geotrain.wan.shaper import ShaperConfig
        from geotrain.wan.striped import StripedTransport
        from geotrain.wan.temporal import turns_via_store

        cfg = json.loads(Path(os.environ["GEOTRAIN_WAN_CONFIG"]).read_text())
        self.rank = dist.get_rank()
        self.dc = cfg["rank_dc"]
        replica = cfg["rank_replica"]
        self.local = _ORIGINAL(group)
        store = dist.distributed_c10d._get_default_store()
        self.links = cfg["links"]
        self._arbiters = []
        turns = {}
        me = self.dc[self.rank]
        for name, lk in self.links.items():
            src, dst = name.split("->")
            if lk.get("sharing") != "temporal" or src != me:
                continue
            # Every DP pipeline sends over this direction from its own rank; the first in the
            # order serves the arbiter.
            order = list(lk["order"]) or sorted(set(replica))
            client, arbiter = turns_via_store(store, name, replica[self.rank], order, host="127.0.0.1",
                                              is_host=replica[self.rank] == order[0])
            turns[name] = client
            if arbiter is not None:
                self._arbiters.append(arbiter)

        def link(dst_rank: int) -> dict:
            return self.links[f"{me}->{self.dc[dst_rank]}"]

        def shaper(dst_rank: int):
            lk = link(dst_rank)
            # With strict pacing the two pacers book one after the other, so pass the aggregate cap
            # only where it binds (n connections together faster than the link).
            binds = lk["connections"] * lk["per_connection_gbps"] > lk["aggregate_gbps"]
            return ShaperConfig(per_connection_gbps=None if binds else lk["per_connection_gbps"],
                                aggregate_gbps=lk["aggregate_gbps"] if binds else None, delay_ms=lk["delay_ms"])

        # Small stripes: a boundary tensor of a tiny model (tens of KB) must still spread over n connections.
        self.wan = StripedTransport(self.rank, store, connections=lambda d: link(d)["connections"], shaper=shaper,
                                    turns=lambda d: turns.get(f"{me}->{self.dc[d]}"), prefix="geotrain/calibrate",
                                    min_chunk_bytes=MIN_CHUNK_BYTES)

    def _remote(self, peer: int) -> bool:
        return self.dc[peer] != self.dc[self.rank]

    def send(self, tensor, dst: int, tag: int):
        return (self.wan if self._remote(dst) else self.local).send(tensor, dst, tag)

    def recv(self, tensor, src: int, tag: int):
        return (self.wan if self._remote(src) else self.local).recv(tensor, src, tag)


def install() -> None:
    """Make the runtime build `WanRouting` where it builds its default transport."""
    global _ORIGINAL
    import geotrain.runtime.transport as transport
    from geotrain.wan import shaper

    if _ORIGINAL is None:
        _ORIGINAL = transport.TorchTransport
    transport.TorchTransport = WanRouting
    shaper.Pacer.reserve = strict_reserve


def main(argv: list[str] | None = None) -> int:
    from geotrain.runtime import worker

    if os.environ.get("GEOTRAIN_WAN_CONFIG"):
        install()
    if os.environ.get("GEOTRAIN_SWITCH_INTERVAL_S"):
        # The transport's threads wait for the GIL while the compute thread runs Python; the default
        # 5 ms switch interval then adds up to 5 ms to every hand-off of a WAN message.
        sys.setswitchinterval(float(os.environ["GEOTRAIN_SWITCH_INTERVAL_S"]))
    return worker.main(argv)


if __name__ == "__main__":
    sys.exit(main())
