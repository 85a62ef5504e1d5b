"""Small socket helpers shared by the striped transport and the turn arbiter.

`open_connections` opens K plain TCP connections (what a real cluster uses). The emulation's
variant that binds consecutive even source ports (one htb bucket per connection) lives in
`geotrain.emulation.ports`.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def open_connections(host: str, port: int, k: int, bind_host: str | None = None,
                     timeout: float = 30.0) -> list[socket.socket]:
    """K connected TCP sockets to (host, port), from `bind_host` (any port) when given."""
    return [connect(host, port, bind_host, 0, timeout) for _ in range(k)]


def connect(host: str, port: int, bind_host: str | None, src_port: int, timeout: float) -> socket.socket:
    """One connected, tuned TCP socket, bound to (bind_host, src_port) when either is set."""
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


def unacknowledged_bytes(sock: socket.socket) -> int:
    """Bytes written to `sock` that the peer's TCP has not acknowledged yet (unsent ones included:
    Linux's SIOCOUTQ, the same ioctl number as TIOCOUTQ); 0 where the socket cannot tell."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


def close_quietly(*socks: socket.socket) -> None:
    """Shut down and close each socket, whatever state it is in (a peer already gone, a socket
    never connected): a thread blocked in recv on it wakes with EOF instead of waiting forever."""
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` completely from `sock` (raises ConnectionError on EOF)."""
    got = 0
    n = len(view)
    while got < n:
        r = sock.recv_into(view[got:], min(n - got, 4 << 20))
        if r == 0:
            raise ConnectionError("peer closed the connection")
        got += r
