"""What a listener of the WAN layer lets in before a peer has proved anything.

A hostile or broken opener must not exhaust or stall a rank (docs/DECISIONS.md, Transport), so
every listener (striped transport, turn arbiter) accepts through `accept_loop`, which survives
descriptor exhaustion (logs once per burst, backs off 50 ms doubling to 1 s), and admits through
a `Gate`: a handshake *deadline* that bytes do not extend (`HANDSHAKE_TIMEOUT_S`,
GEOTRAIN_HANDSHAKE_TIMEOUT_S; a known peer's address gets TRUSTED_FACTOR times as long, its K
connections handshaking one after another), at most `per_source` connections of one address in
their handshake (default 128), and from addresses that are not a known peer's at most `untrusted`
together (default a quarter of the descriptor limit), so a flood cannot take the descriptors the
rank itself needs.
"""

from __future__ import annotations

import errno
import heapq
import os
import resource
import socket
import threading
import time
from collections.abc import Callable

HANDSHAKE_TIMEOUT_S = 10.0          # from accept to an authenticated channel, in total
PER_SOURCE = 128                    # connections of one address in their handshake at once
TRUSTED_FACTOR = 6                  # a known peer's deadline: this many times handshake_s
EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def handshake_timeout() -> float:
    """The handshake deadline: GEOTRAIN_HANDSHAKE_TIMEOUT_S, else HANDSHAKE_TIMEOUT_S."""
    try:
        value = float(os.environ.get("GEOTRAIN_HANDSHAKE_TIMEOUT_S", HANDSHAKE_TIMEOUT_S))
    except ValueError:
        return HANDSHAKE_TIMEOUT_S
    return value if 0 < value < 3600 else HANDSHAKE_TIMEOUT_S


def accept_loop(listener: socket.socket, closed: Callable[[], bool], handle: Callable[[socket.socket, tuple], None],
                say: Callable[[str], None]) -> None:
    """Accept connections until `closed()` (or the listener is closed), handing each to `handle`."""
    backoff, last_said = 0.05, 0.0
    while not closed():
        try:
            conn, addr = listener.accept()
        except OSError as e:
            if closed() or listener.fileno() < 0 or e.errno in (errno.EBADF, errno.EINVAL):
                return
            if e.errno in EXHAUSTED:
                if time.monotonic() - last_said > 10:
                    last_said = time.monotonic()
                    say(f"cannot accept a connection ({os.strerror(e.errno)}); backing off and accepting again")
                time.sleep(backoff)
                backoff = min(2 * backoff, 1.0)
            continue                                  # ECONNABORTED and the like: the next one
        backoff = 0.05
        handle(conn, addr)


class Ticket:
    """One admitted connection's place at the gate (see `Gate.admit`)."""

    __slots__ = ("deadline", "expired", "fd", "limit_s", "open", "source", "stranger")

    def __init__(self, fd: int, source: str, deadline: float, stranger: bool = False, limit_s: float = 0.0):
        self.fd, self.source, self.deadline, self.stranger, self.limit_s = fd, source, deadline, stranger, limit_s
        self.open, self.expired = True, False

    def __lt__(self, other: Ticket) -> bool:
        return self.deadline < other.deadline

    def failure(self, error) -> str:
        """Why this opener's handshake failed: the gate's deadline when it fired, else `error`."""
        return f"handshake not finished within {self.limit_s:g} s" if self.expired else str(error)


def _untrusted_cap() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft if soft != resource.RLIM_INFINITY else 4096) // 4)


class Gate:
    """Per-source caps and handshake deadlines for one listener (see the module docstring)."""

    def __init__(self, per_source: int = PER_SOURCE, handshake_s: float | None = None, untrusted: int | None = None,
                 trusted: Callable[[], set[str]] = set):
        self.per_source, self.trusted = per_source, trusted
        self.untrusted = untrusted if untrusted is not None else _untrusted_cap()
        self.handshake_s = handshake_s if handshake_s is not None else handshake_timeout()
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._strangers = 0                  # pending connections from untrusted sources
        self._heap: list[Ticket] = []
        self._wake = threading.Condition(self._lock)
        self._reaper: threading.Thread | None = None

    def serve(self, conn: socket.socket, addr, serve: Callable, name: str, drops: Callable[[str], None]) -> None:
        """A listener's accept handler: admit `conn`, then `serve(conn, addr, ticket)` on a thread of
        its own; refused (or no thread to be had, in a flood) -> closed, and said through `drops`."""
        ticket = self.admit(conn, addr)
        if isinstance(ticket, str):
            conn.close()
            drops(f"dropped a connection from {addr[0]}:{addr[1]}: {ticket}")
            return
        try:
            threading.Thread(target=serve, args=(conn, addr, ticket), daemon=True, name=name).start()
        except RuntimeError:                   # no thread to be had: this one waits for the peer's retry
            self.done(ticket)
            conn.close()

    def admit(self, conn: socket.socket, addr) -> Ticket | str:
        """A ticket for a new connection, its deadline armed; or why not (the caller closes it): its
        source, or the untrusted sources together, hold their share of handshakes already."""
        source = str(addr[0])
        stranger = source not in self.trusted()
        with self._lock:
            if self._pending.get(source, 0) >= self.per_source:
                return f"{self.per_source} connections of {source} are in their handshake already"
            if stranger and self._strangers >= self.untrusted:
                return f"{self.untrusted} connections from addresses not a peer's are in their handshake already"
            self._pending[source] = self._pending.get(source, 0) + 1
            self._strangers += stranger
            limit = self.handshake_s * (1 if stranger else TRUSTED_FACTOR)
            ticket = Ticket(conn.fileno(), source, time.monotonic() + limit, stranger, limit)
            heapq.heappush(self._heap, ticket)
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="handshake-deadline", daemon=True)
                self._reaper.start()
            self._wake.notify()
        return ticket

    def done(self, ticket: Ticket) -> None:
        """The handshake is over (passed or failed): disarm the deadline before the socket may close."""
        with self._lock:
            if ticket.open:
                ticket.open = False
                self._strangers -= ticket.stranger
                n = self._pending.get(ticket.source, 1) - 1
                if n:
                    self._pending[ticket.source] = n
                else:
                    self._pending.pop(ticket.source, None)

    def _reap(self) -> None:
        with self._lock:
            while True:
                while self._heap and not self._heap[0].open:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._wake.wait()
                    continue
                left = self._heap[0].deadline - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                ticket = heapq.heappop(self._heap)
                ticket.expired = True
                _shutdown_fd(ticket.fd)   # under the lock: the owner cannot have closed (and reused) the fd yet


def _shutdown_fd(fd: int) -> None:
    """Shut down the socket behind `fd` (a blocked recv on it returns): through a duplicate, so the
    owner's socket object (plain or TLS) is left to close it."""
    try:
        dup = os.dup(fd)
    except OSError:
        return
    s = socket.socket(fileno=dup)
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()
