"""A client that sends one byte at a time: what a handshake deadline must cut off (a per-read timeout
restarts with every byte, so such a peer would hold its thread and descriptor for minutes)."""

from __future__ import annotations

import socket
import time


def drip_until_closed(sock: socket.socket, give_up_s: float = 4.0) -> float:
    """Drip b"G" every 0.3 s until the server closes; the seconds it took (give_up_s if it never did)."""
    sock.settimeout(0.3)
    t0 = time.monotonic()
    while time.monotonic() - t0 < give_up_s:
        try:
            sock.sendall(b"\x47")
            if sock.recv(1) == b"":
                break
        except TimeoutError:
            pass
        except OSError:
            break
    return time.monotonic() - t0
