"""Connections the emulated WAN can cap one by one: K sockets on consecutive even source ports.

The router's htb puts each TCP connection in a bucket chosen by source-port bits 1..6 (`htb`), as
a real long fat pipe limits each connection by its window. Binding one transfer's K connections to
consecutive even ports puts them in K buckets; `first_bucket` says where the block starts, so the
transports of several ranks of one DC take disjoint buckets too (docs/DECISIONS.md, Emulation). A
real cluster needs none of this: `StripedTransport` gets it as its `connect` hook only inside the
emulation.
"""

from __future__ import annotations

import random
import socket

from geotrain.emulation.htb import BUCKETS
from geotrain.transport.sockets import connect

PORT_LO, PORT_HI = 32768, 60928


def spread_port_connections(host: str, port: int, k: int, bind_host: str | None = None,
                            timeout: float = 30.0, first_bucket: int = 0) -> list[socket.socket]:
    """K connected TCP sockets to (host, port), each in its own source-port bucket when possible:
    buckets first_bucket, first_bucket + 1, ... (mod BUCKETS)."""
    if k > BUCKETS:
        return [connect(host, port, bind_host, 0, timeout) for _ in range(k)]
    rng = random.Random()
    for _attempt in range(20):
        base = rng.randrange(PORT_LO, PORT_HI - 2 * BUCKETS - 128, 128) // 128 * 128
        socks: list[socket.socket] = []
        try:
            for i in range(k):
                socks.append(connect(host, port, bind_host or "", base + 2 * ((first_bucket + i) % BUCKETS), timeout))
            return socks
        except OSError as e:
            for s in socks:
                s.close()
            if e.errno not in (98, 99):        # EADDRINUSE / EADDRNOTAVAIL: try another block
                raise
    return [connect(host, port, bind_host, 0, timeout) for _ in range(k)]
