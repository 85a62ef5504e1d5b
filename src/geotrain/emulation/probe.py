"""Measure a (possibly emulated) WAN path with plain TCP: round-trip time and throughput.

    python -m geotrain.emulation.probe serve --host ADDR            # prints "port N", serves until killed
    python -m geotrain.emulation.probe ping  --host ADDR --port N   # prints JSON {"rtt_ms": median}
    python -m geotrain.emulation.probe send  --host ADDR --port N --connections K --seconds S

Throughput is measured at the receiver (the bottleneck side): each connection's bytes arriving
after a warm-up (slow start, queue fill) divided by the time they took, summed over connections.
No torch import, so a probe process starts in a fraction of a second.

Both ends read a secret from the 0600 file named by GEOTRAIN_SECRET_FILE (`probe_env` makes one),
and every connection starts with `transport.auth`'s challenge-response handshake: the server talks only
to openers that hold it, and logs any other connection in one line and drops it; openers are admitted
through `transport.admission.Gate` (a deadline bytes do not extend, long enough for a sender's K
connections handshaking one after another; a per-address cap). What follows the handshake is plain
TCP on purpose: the probe measures the network, not the cost of MACs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

from geotrain.emulation.ports import spread_port_connections as open_connections
from geotrain.errors import GeotrainError
from geotrain.transport.admission import TRUSTED_FACTOR, Gate, accept_loop, handshake_timeout
from geotrain.transport.auth import (
    ANY_RANK,
    PROBE,
    SECRET_ENV,
    DropLog,
    client_handshake,
    new_secret,
    read_secret_file,
    server_handshake,
    write_secret_file,
)
from geotrain.transport.sockets import recv_exact, tune

PING_SIZE = 64
SINK_HDR = struct.Struct("!cd")         # mode, warm-up seconds
SINK_REPLY = struct.Struct("!dd")       # bytes after warm-up, seconds they took


def probe_env(folder: Path) -> dict[str, str]:
    """A fresh secret in FOLDER/probe_secret (0600); the environment both probe ends need."""
    path = Path(folder) / "probe_secret"
    path.unlink(missing_ok=True)
    return {SECRET_ENV: str(write_secret_file(path, new_secret()))}


def _secret() -> bytes:
    path = os.environ.get(SECRET_ENV)
    if not path:
        raise GeotrainError(f"probe: set {SECRET_ENV} to the 0600 file holding the probe's secret (both ends)")
    return read_secret_file(Path(path))


def _connect(host: str, port: int, k: int, secret: bytes) -> list[socket.socket]:
    socks = open_connections(host, port, k)
    for s in socks:
        client_handshake(s, secret, PROBE, 0, ANY_RANK)
    return socks


def _handle(conn: socket.socket, secret: bytes, drops: DropLog, gate: Gate, addr, ticket) -> None:
    try:
        tune(conn)
        try:
            server_handshake(conn, secret, PROBE, ANY_RANK)
        except ConnectionError as e:
            drops(f"dropped a connection from {addr[0]}:{addr[1]}: {ticket.failure(e)}")
            return
        finally:
            gate.done(ticket)
        hdr = bytearray(SINK_HDR.size)
        recv_exact(conn, memoryview(hdr))
        mode, warm = SINK_HDR.unpack(hdr)
        if mode == b"P":
            buf = bytearray(PING_SIZE)
            while True:
                try:
                    recv_exact(conn, memoryview(buf))
                except ConnectionError:
                    return
                conn.sendall(buf)
        buf = bytearray(1 << 20)
        t0 = None
        counted, t_first, t_last = 0, 0.0, 0.0
        while True:
            n = conn.recv_into(buf)
            now = time.monotonic()
            if n == 0:
                break
            if t0 is None:
                t0 = now
            elif now - t0 >= warm:
                if not t_first:
                    t_first = now          # the window opens here; these bytes arrived before it
                else:
                    counted += n
                t_last = now
        conn.sendall(SINK_REPLY.pack(float(counted), max(t_last - t_first, 1e-9)))
    except OSError:
        pass
    finally:
        conn.close()


def serve(host: str, port: int = 0) -> None:
    secret, drops = _secret(), DropLog("probe", prefix="geotrain emulation")
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, port))
    ls.listen(256)
    print(f"port {ls.getsockname()[1]}", flush=True)
    gate = Gate(handshake_s=TRUSTED_FACTOR * handshake_timeout())
    accept_loop(ls, lambda: False,              # out of descriptors: back off, accept again (admission)
                lambda conn, addr: gate.serve(conn, addr, lambda c, a, t: _handle(c, secret, drops, gate, a, t),
                                              "probe", drops),
                lambda line: print(f"geotrain emulation: probe: {line}", file=sys.stderr, flush=True))


def ping(host: str, port: int, count: int = 20) -> float:
    """Median TCP round trip (ms) of a 64-byte message."""
    s = _connect(host, port, 1, _secret())[0]
    s.sendall(SINK_HDR.pack(b"P", 0.0))
    msg = bytearray(PING_SIZE)
    times = []
    for _ in range(count + 2):
        t = time.perf_counter()
        s.sendall(msg)
        recv_exact(s, memoryview(msg))
        times.append((time.perf_counter() - t) * 1e3)
    s.close()
    return statistics.median(times[2:])


def send(host: str, port: int, connections: int, seconds: float, warmup: float = 1.0) -> float:
    """Aggregate receiver-side throughput (Gbit/s) of `connections` parallel TCP streams."""
    socks = _connect(host, port, connections, _secret())
    results: list[float] = []
    payload = bytes(1 << 20)

    def stream(s: socket.socket) -> None:
        s.sendall(SINK_HDR.pack(b"S", warmup))
        end = time.monotonic() + warmup + seconds
        while time.monotonic() < end:
            s.sendall(payload[: 256 << 10])
        s.shutdown(socket.SHUT_WR)
        reply = bytearray(SINK_REPLY.size)
        recv_exact(s, memoryview(reply))
        nbytes, dt = SINK_REPLY.unpack(reply)
        results.append(nbytes * 8 / dt / 1e9)
        s.close()

    threads = [threading.Thread(target=stream, args=(s,)) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["serve", "ping", "send"])
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--connections", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--count", type=int, default=20)
    a = ap.parse_args(argv)
    try:
        _secret()
    except GeotrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.mode == "serve":
        serve(a.host, a.port)
    elif a.mode == "ping":
        print(json.dumps({"rtt_ms": ping(a.host, a.port, a.count)}))
    else:
        gbps = send(a.host, a.port, a.connections, a.seconds, a.warmup)
        print(json.dumps({"gbps": gbps, "connections": a.connections}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
