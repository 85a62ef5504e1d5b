"""Temporal sharing of a WAN link between DP pipelines (Atlas), and fair sharing as the baseline.

With fair sharing every pipeline sends whenever it is ready and TCP splits the link between them:
each transfer takes D times longer and every pipeline stalls. With temporal sharing the pipelines
that send over one link (one direction) take turns in the plan's order -- pipeline 0's transfer,
then pipeline 1's, ... cyclically -- each at the link's full rate; the turn order staggers the
pipelines, so one computes while another sends.

The transport consults a `Turns` object around every cross-DC send: `acquire()` before the first
byte, `release()` after the last. Implementations:
  * `FairSharing`      -- no-op (everyone at once), the baseline;
  * `TurnArbiter`      -- the baton itself (in-process; `LocalTurns` binds it to one pipeline);
  * `RemoteTurns`      -- a client of an arbiter served over TCP by one process in the sending DC
                          (`TurnArbiter.serve`), for pipelines in different processes.
Wire protocol: hello = struct (magic, pipeline key); then one byte per request: b"A" acquire
(answered b"G" when granted), b"R" release, b"L" leave. No pickle.

Every pipeline must make the same number of sends per round on the link (DP pipelines are
symmetric); a pipeline that finishes early calls `leave()` so the others do not wait for it.
A wait longer than `timeout_s` raises instead of hanging, naming whose turn it was.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Sequence

from geotrain.wan.sockets import recv_exact, tune

MAGIC = 0x47545455                 # "GTTU"
HELLO = struct.Struct("!Iq")


class TurnTimeout(RuntimeError):
    pass


class FairSharing:
    """Baseline: no coordination; concurrent transfers split the link (TCP fairness)."""

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass

    def leave(self) -> None:
        pass


class TurnArbiter:
    """Grants a link to one pipeline at a time, cycling through `order` (pipeline keys)."""

    def __init__(self, order: Sequence[int], timeout_s: float = 600.0):
        if not order or len(set(order)) != len(order):
            raise ValueError(f"turn order must list distinct pipelines, got {list(order)}")
        self.order = list(order)
        self.timeout_s = timeout_s
        self.turn = 0                  # index into self.order of the pipeline holding or next to hold the link
        self.holder: int | None = None
        self.grants: list[int] = []    # pipeline keys in the order they were granted (for tests / traces)
        self._cv = threading.Condition()
        self._server: socket.socket | None = None

    def acquire(self, key: int) -> None:
        with self._cv:
            if key not in self.order:
                raise ValueError(f"pipeline {key} is not in the turn order {self.order}")
            ok = self._cv.wait_for(lambda: self.holder is None and self.order[self.turn] == key, self.timeout_s)
            if not ok:
                raise TurnTimeout(f"pipeline {key} waited {self.timeout_s:.0f} s for the link; it is pipeline "
                                  f"{self.order[self.turn]}'s turn (order {self.order})")
            self.holder = key
            self.grants.append(key)

    def release(self, key: int) -> None:
        with self._cv:
            if self.holder != key:
                raise ValueError(f"pipeline {key} releases a link held by {self.holder}")
            self.holder = None
            self.turn = (self.turn + 1) % len(self.order)
            self._cv.notify_all()

    def leave(self, key: int) -> None:
        """Drop `key` from the rotation (it has nothing more to send)."""
        with self._cv:
            if key not in self.order:
                return
            i = self.order.index(key)
            if self.holder == key:
                self.holder = None
            self.order.pop(i)
            if self.order:
                if i < self.turn:
                    self.turn -= 1
                self.turn %= len(self.order)
            else:
                self.order, self.turn = [key], 0       # nobody left: keep the arbiter usable
            self._cv.notify_all()

    # ---------------------------------------------------------------- TCP service
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Serve this arbiter to other processes; returns (host, port). Threads are daemons."""
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((host, port))
        ls.listen(64)
        self._server = ls
        threading.Thread(target=self._accept, daemon=True, name="turn-arbiter").start()
        return host, ls.getsockname()[1]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True, name="turn-client").start()

    def _client(self, conn: socket.socket) -> None:
        tune(conn)
        key = None
        try:
            hello = bytearray(HELLO.size)
            recv_exact(conn, memoryview(hello))
            magic, key = HELLO.unpack(hello)
            if magic != MAGIC:
                return
            op = bytearray(1)
            while True:
                recv_exact(conn, memoryview(op))
                if op == b"A":
                    try:
                        self.acquire(key)
                        conn.sendall(b"G")
                    except (TurnTimeout, ValueError):
                        conn.sendall(b"T")
                elif op == b"R":
                    self.release(key)
                elif op == b"L":
                    self.leave(key)
        except (OSError, ConnectionError, ValueError):
            pass
        finally:
            if key is not None and self.holder == key:    # a client died holding the link: free it
                self.release(key)
            conn.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


class LocalTurns:
    """One pipeline's view of an in-process arbiter."""

    def __init__(self, arbiter: TurnArbiter, key: int):
        self.arbiter, self.key = arbiter, key

    def acquire(self) -> None:
        self.arbiter.acquire(self.key)

    def release(self) -> None:
        self.arbiter.release(self.key)

    def leave(self) -> None:
        self.arbiter.leave(self.key)


class RemoteTurns:
    """One pipeline's client of a `TurnArbiter.serve` service (lazy connect, thread-safe)."""

    def __init__(self, host: str, port: int, key: int, bind_host: str | None = None):
        self.addr, self.key, self.bind_host = (host, port), key, bind_host
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _conn(self) -> socket.socket:
        if self._sock is None:
            s = socket.create_connection(self.addr, timeout=60,
                                         source_address=(self.bind_host, 0) if self.bind_host else None)
            s.settimeout(None)
            tune(s)
            s.sendall(HELLO.pack(MAGIC, self.key))
            self._sock = s
        return self._sock

    def acquire(self) -> None:
        with self._lock:
            s = self._conn()
            s.sendall(b"A")
            reply = bytearray(1)
            recv_exact(s, memoryview(reply))
        if reply != b"G":
            raise TurnTimeout(f"pipeline {self.key}: the link arbiter at {self.addr} timed out waiting for its turn")

    def release(self) -> None:
        with self._lock:
            self._conn().sendall(b"R")

    def leave(self) -> None:
        with self._lock:
            self._conn().sendall(b"L")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def turns_via_store(store, name: str, key: int, order: Sequence[int], *, host: str, is_host: bool,
                    timeout_s: float = 600.0) -> tuple[RemoteTurns, TurnArbiter | None]:
    """Runtime helper: the process with `is_host` serves the arbiter for link-direction `name` and
    publishes its address in the (torch.distributed) store; every sender gets a RemoteTurns client.
    Returns (client, arbiter-or-None); keep the arbiter alive as long as the link is used."""
    arbiter = None
    if is_host:
        arbiter = TurnArbiter(order, timeout_s)
        h, p = arbiter.serve(host)
        store.set(f"geotrain/turns/{name}", f"{h}:{p}")
    raw = store.get(f"geotrain/turns/{name}")
    h, _, p = (raw.decode() if isinstance(raw, bytes) else str(raw)).rpartition(":")
    return RemoteTurns(h, int(p), key, bind_host=host), arbiter
