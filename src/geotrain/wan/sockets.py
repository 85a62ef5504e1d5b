"""Small socket helpers shared by the striped transport and the WAN probes.

`open_connections` binds K connections to consecutive even source ports (a block aligned to 128),
so their source-port bits 1..6 differ: the emulator's per-connection htb buckets then hold exactly
one of our connections each, as K separate TCP connections would be window-limited on a real WAN.
"""

from __future__ import annotations

import random
import socket

from geotrain.wan.shaping import BUCKETS

PORT_LO, PORT_HI = 32768, 60928


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def open_connections(host: str, port: int, k: int, bind_host: str | None = None,
                     timeout: float = 30.0, spread_ports: bool = True) -> list[socket.socket]:
    """K connected TCP sockets to (host, port), each in its own source-port bucket when possible."""
    if not spread_ports or k > BUCKETS:
        return [_connect(host, port, bind_host, 0, timeout) for _ in range(k)]
    rng = random.Random()
    for _attempt in range(20):
        base = rng.randrange(PORT_LO, PORT_HI - 2 * k, 128) // 128 * 128
        socks: list[socket.socket] = []
        try:
            for i in range(k):
                socks.append(_connect(host, port, bind_host or "", base + 2 * i, timeout))
            return socks
        except OSError as e:
            for s in socks:
                s.close()
            if e.errno not in (98, 99):        # EADDRINUSE / EADDRNOTAVAIL: try another block
                raise
    return [_connect(host, port, bind_host, 0, timeout) for _ in range(k)]


def _connect(host: str, port: int, bind_host: str | None, src_port: int, timeout: float) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if src_port or bind_host:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # a TIME_WAIT port is fine to reuse
            s.bind((bind_host or "", src_port))
        s.settimeout(timeout)
        s.connect((host, port))
        s.settimeout(None)
        tune(s)
        return s
    except OSError:
        s.close()
        raise


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` completely from `sock` (raises ConnectionError on EOF)."""
    got = 0
    n = len(view)
    while got < n:
        r = sock.recv_into(view[got:], min(n - got, 4 << 20))
        if r == 0:
            raise ConnectionError("peer closed the connection")
        got += r
