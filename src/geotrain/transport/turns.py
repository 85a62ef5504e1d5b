"""Temporal sharing of a WAN link between DP pipelines (Atlas), and fair sharing as the baseline.

Fair sharing lets every pipeline send at once and TCP splits the link, so every transfer takes
D times longer and every pipeline stalls. Temporal sharing gives pipelines turns, each transfer
alone at the link's full rate, so one computes while another sends. Turns are work-conserving (a
pipeline with nothing ready is skipped, never waited for) and `slots` transfers hold the link at
once when one cannot fill it (`turn_slots`, the one rule simulator, planner and runtime use). A
turn is handed on when its bytes have drained from the network's queue, not when they were
written (`Handoff`), so the next holder never queues behind it (docs/DECISIONS.md, Transport).

The transport calls a `Turns` object around every cross-DC send: `acquire()` before the first
byte, `release()` once drained. `FairSharing` is a no-op; `TurnArbiter` the baton (`LocalTurns`
in-process); `RemoteTurns` its client over TCP (`TurnArbiter.serve`). A wait longer than
`timeout_s` raises, naming who holds the link.
"""

from __future__ import annotations

import math
import socket
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from geotrain.transport.admission import Gate, accept_loop
from geotrain.transport.auth import (
    ANY_RANK,
    TURNS,
    AuthError,
    DropLog,
    ProtocolError,
    client_handshake,
    run_secret,
    server_handshake,
)
from geotrain.transport.sockets import tune
from geotrain.transport.striped_frames import store_get

OP = struct.Struct("!c")           # one request or answer byte per frame


# What one turn costs a transfer: the RemoteTurns grant round trip (0.15 ms median, 0.25 ms p90 on
# this machine's loopback; `bench/bench_rehearse.py --sharing` prints it) and a thread's wake-up.
# A holder hands its turn on this much early (`Handoff.lead_s`), so on a busy link the next grant
# overlaps its last bytes and the link loses nothing; a transfer that finds the link free still
# waits this long. The simulator adds it to every temporal transfer and the planner's estimate
# too, so temporal sharing is chosen only where its gain exceeds it (a 16 KiB transfer at 1 Gbit/s
# takes 0.13 ms: less than its turn).
TURN_OVERHEAD_S = 0.0003


class TurnTimeout(RuntimeError):
    pass


class FairSharing:
    """Baseline: no coordination; concurrent transfers split the link (TCP fairness)."""

    handoff = None

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass

    def leave(self) -> None:
        pass


def concurrent_turns(capacity: float, flow_rate: float) -> int:
    """How many transfers hold a temporally shared link at once: 1 when one transfer's
    connections fill it, else the fewest whose flows together fill it (the simulator and the
    runtime use the same rule)."""
    if flow_rate <= 0 or flow_rate >= capacity:
        return 1
    return max(1, math.ceil(capacity / flow_rate - 1e-9))


def turn_slots(sharing: str, capacity: float, flow_rate: float, pipelines: int) -> int:
    """The take-turns-or-share-fairly rule of one link direction that `pipelines` DP pipelines send
    over, each transfer (one TP index's ring: its connections) reaching `flow_rate` of `capacity`:
    under temporal sharing, when fewer transfers than pipelines fill the link (`concurrent_turns`),
    the pipelines take turns, that many at once -- the count is returned; else 0, no turns: every
    pipeline sends when ready and the link is shared fairly. The runtime's arbiters, the simulator,
    the planner's estimate, the rehearsal's check and the link-sharing measurement all decide here."""
    if sharing != "temporal":
        return 0
    slots = concurrent_turns(capacity, flow_rate)
    return slots if slots < pipelines else 0


@dataclass(frozen=True)
class Handoff:
    """When a turn may pass: once at most `bytes_per_s` x (`rtt_s` + `lead_s`) bytes of the
    transfer are unacknowledged (see the module docstring). `bytes_per_s`: the rate one transfer
    gets in its turn; `rtt_s`: the link's round trip."""

    bytes_per_s: float
    rtt_s: float
    lead_s: float = TURN_OVERHEAD_S    # handed on this much early: the next holder's grant takes that long

    @property
    def in_flight_bytes(self) -> float:
        return self.bytes_per_s * (self.rtt_s + self.lead_s)


def link_handoff(capacity_gbps: float, flow_gbps: float, latency_ms: float, slots: int = 1) -> Handoff:
    """The hand-off for a link of `capacity_gbps` and one-way `latency_ms` whose transfers each
    reach `flow_gbps` on their connections, `slots` of them holding it at once."""
    rate = min(flow_gbps, capacity_gbps / max(1, slots))
    return Handoff(rate * 1e9 / 8, 2 * latency_ms / 1e3)


class TurnArbiter:
    """Grants a link to at most `slots` pipelines at a time, work-conserving: when a slot is free,
    the first *waiting* pipeline in the cyclic `order` starting at the current turn gets it."""

    def __init__(self, order: Sequence[int], timeout_s: float = 600.0, slots: int = 1):
        if not order or len(set(order)) != len(order):
            raise ValueError(f"turn order must list distinct pipelines, got {list(order)}")
        self.order = list(order)
        self.timeout_s = timeout_s
        self.slots = max(1, int(slots))
        self.turn = 0                  # index into self.order where the search for the next grant starts
        self.holders: list[int] = []
        self.waiting: dict[int, int] = {}   # pipeline -> acquires it has waiting
        self.grants: list[int] = []    # pipeline keys in the order they were granted (for tests / traces)
        self._cv = threading.Condition()
        self._server: socket.socket | None = None
        self._secret = b""

    @property
    def holder(self) -> int | None:
        return self.holders[0] if self.holders else None

    def _next(self) -> int | None:
        """The waiting pipeline a free slot goes to, or None."""
        if len(self.holders) >= self.slots or not self.waiting:
            return None
        n = len(self.order)
        for i in range(n):
            k = self.order[(self.turn + i) % n]
            if k in self.waiting:
                return k
        return None

    def acquire(self, key: int) -> None:
        with self._cv:
            if key not in self.order:
                raise ValueError(f"pipeline {key} is not in the turn order {self.order}")
            self.waiting[key] = self.waiting.get(key, 0) + 1
            try:
                ok = self._cv.wait_for(lambda: self._next() == key, self.timeout_s)
            finally:
                self.waiting[key] -= 1
                if not self.waiting[key]:
                    del self.waiting[key]
            if not ok:
                self._cv.notify_all()   # the next in line may be served now that this one gave up
                raise TurnTimeout(f"pipeline {key} waited {self.timeout_s:.0f} s for the link; held by pipeline(s) "
                                  f"{self.holders} (order {self.order}, {self.slots} at a time)")
            self.holders.append(key)
            self.grants.append(key)
            self.turn = (self.order.index(key) + 1) % len(self.order)
            self._cv.notify_all()

    def release(self, key: int) -> None:
        with self._cv:
            if key not in self.holders:
                raise ValueError(f"pipeline {key} releases a link held by {self.holders}")
            self.holders.remove(key)
            self._cv.notify_all()

    def leave(self, key: int) -> None:
        """Drop `key` from the rotation (it has nothing more to send)."""
        with self._cv:
            if key not in self.order:
                return
            i = self.order.index(key)
            if key in self.holders:
                self.holders.remove(key)
            self.order.pop(i)
            if self.order:
                if i < self.turn:
                    self.turn -= 1
                self.turn %= len(self.order)
            else:
                self.order, self.turn = [key], 0       # nobody left: keep the arbiter usable
            self._cv.notify_all()

    # ---------------------------------------------------------------- TCP service
    def serve(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes) -> tuple[str, int]:
        """Serve this arbiter to other processes holding `secret`; returns (host, port). Daemon threads.

        Wire protocol: `transport.auth`'s challenge-response handshake (the client's pipeline key is
        the rank it proves), then one authenticated frame per request: b"A" acquire (answered b"G"
        when granted, b"T" on a timeout), b"R" release, b"L" leave. A connection failing the
        handshake or sending an unauthenticated or unknown frame is logged and dropped; it never
        holds or frees a turn. No pickle."""
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((host, port))
        ls.listen(64)
        self._server, self._secret = ls, secret
        self.drops = DropLog(f"turn arbiter {host}:{ls.getsockname()[1]}")
        self.gate = Gate(trusted=lambda: {host})   # (transport.admission) its clients: ranks of its own DC
        threading.Thread(target=self._accept, daemon=True, name="turn-arbiter").start()
        return host, ls.getsockname()[1]

    def _accept(self) -> None:
        accept_loop(self._server, lambda: self._server.fileno() < 0,
                    self._admit, lambda line: print(f"geotrain wan: turn arbiter: {line}", file=sys.stderr, flush=True))

    def _admit(self, conn: socket.socket, addr) -> None:
        self.gate.serve(conn, addr, self._client, "turn-client", self.drops)

    def _client(self, conn: socket.socket, addr, ticket) -> None:
        key = None
        try:
            tune(conn)
            try:
                key, _, channel = server_handshake(conn, self._secret, TURNS, ANY_RANK)
            except (AuthError, OSError) as e:
                raise (AuthError(ticket.failure(e)) if ticket.expired else e) from None
            finally:
                self.gate.done(ticket)
            while True:
                (op,), _ = channel.recv(OP, lambda f: 0, 0)
                if op == b"A":
                    try:
                        self.acquire(key)
                        channel.send(OP.pack(b"G"))
                    except (TurnTimeout, ValueError):
                        channel.send(OP.pack(b"T"))
                elif op == b"R":
                    self.release(key)
                elif op == b"L":
                    self.leave(key)
                else:
                    raise ProtocolError(f"unknown request {op!r}")
        except (AuthError, ProtocolError) as e:
            self.drops(f"dropped a connection from {addr[0]}:{addr[1]}"
                       f"{'' if key is None else f' (pipeline {key})'}: {e}")
        except (OSError, ConnectionError, ValueError):
            pass
        finally:
            if key is not None and key in self.holders:    # a client died holding the link: free it
                self.release(key)
            conn.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


class LocalTurns:
    """One pipeline's view of an in-process arbiter."""

    def __init__(self, arbiter: TurnArbiter, key: int, handoff: Handoff | None = None):
        self.arbiter, self.key, self.handoff = arbiter, key, handoff

    def acquire(self) -> None:
        self.arbiter.acquire(self.key)

    def release(self) -> None:
        self.arbiter.release(self.key)

    def leave(self) -> None:
        self.arbiter.leave(self.key)


class RemoteTurns:
    """One pipeline's client of a `TurnArbiter.serve` service (lazy connect, thread-safe)."""

    def __init__(self, host: str, port: int, key: int, bind_host: str | None = None, *, secret: bytes,
                 handoff: Handoff | None = None):
        self.addr, self.key, self.bind_host, self._secret = (host, port), key, bind_host, secret
        self.handoff = handoff
        self._channel = None
        self._lock = threading.Lock()

    def _conn(self):
        if self._channel is None:
            s = socket.create_connection(self.addr, timeout=60,
                                         source_address=(self.bind_host, 0) if self.bind_host else None)
            tune(s)
            try:
                self._channel = client_handshake(s, self._secret, TURNS, self.key, ANY_RANK)
            except BaseException:
                s.close()
                raise
        return self._channel

    def acquire(self) -> None:
        with self._lock:
            ch = self._conn()
            ch.send(OP.pack(b"A"))
            (reply,), _ = ch.recv(OP, lambda f: 0, 0)
        if reply != b"G":
            raise TurnTimeout(f"pipeline {self.key}: the link arbiter at {self.addr} timed out waiting for its turn")

    def release(self) -> None:
        with self._lock:
            self._conn().send(OP.pack(b"R"))

    def leave(self) -> None:
        with self._lock:
            self._conn().send(OP.pack(b"L"))

    def close(self) -> None:
        if self._channel is not None:
            self._channel.sock.close()
            self._channel = None


def turns_via_store(store, name: str, key: int, order: Sequence[int], *, host: str, is_host: bool,
                    timeout_s: float = 600.0, slots: int = 1, secret: bytes | None = None,
                    handoff: Handoff | None = None) -> tuple[RemoteTurns, TurnArbiter | None]:
    """Runtime helper: the process with `is_host` serves the arbiter for link-direction `name` and
    publishes its address in the (torch.distributed) store; every sender gets a RemoteTurns client.
    Returns (client, arbiter-or-None); keep the arbiter alive as long as the link is used."""
    secret = secret or run_secret(store)
    arbiter = None
    if is_host:
        arbiter = TurnArbiter(order, timeout_s, slots)
        h, p = arbiter.serve(host, secret=secret)
        store.set(f"geotrain/turns/{name}", f"{h}:{p}")
    raw = store_get(store, f"geotrain/turns/{name}", timeout_s, f"turn arbiter of link {name} (pipeline {order[0]})")
    h, _, p = raw.rpartition(":")
    return RemoteTurns(h, int(p), key, bind_host=host, secret=secret, handoff=handoff), arbiter
