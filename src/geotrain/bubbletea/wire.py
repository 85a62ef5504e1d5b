"""A tiny framed protocol for prefill work between the service and training ranks.

Frame: 4-byte big-endian header length, a UTF-8 JSON header, then `payload` raw bytes whose
length the header states. JSON and raw bytes only: nothing from the network is unpickled,
and sizes are bounded before anything is allocated.
"""

from __future__ import annotations

import json
import socket
import struct

from geotrain.transport.sockets import recv_exact

MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 31


class ProtocolError(Exception):
    pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))     # the project's one read-exactly loop
    return bytes(buf)


def send_frame(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    head = json.dumps({**header, "payload": len(payload)}).encode()
    sock.sendall(struct.pack(">I", len(head)) + head + payload)


def recv_frame(sock: socket.socket) -> tuple[dict, bytes]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > MAX_HEADER:
        raise ProtocolError(f"header of {n} bytes is too large")
    try:
        header = json.loads(_recv_exact(sock, n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"bad header: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a JSON object")
    size = header.get("payload", 0)
    if not isinstance(size, int) or not 0 <= size <= MAX_PAYLOAD:
        raise ProtocolError("bad payload size")
    return header, _recv_exact(sock, size) if size else b""
