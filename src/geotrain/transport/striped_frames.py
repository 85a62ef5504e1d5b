"""The striped transport's wire format and the small pieces both of its sides share.

After the handshake (`transport.auth`) a connection carries authenticated frames:
    DATA  sender -> receiver: bytes [offset, offset + nbytes) of message `msg` (tag, seq, total)
    ACK   receiver -> sender: message `msg` arrived whole and verified (the sender may forget it)
    BYE   sender -> receiver: the sender closed its transport on purpose (no reconnect will follow)
Header = FRAME (kind, msg id, tag, seq, total bytes, offset, nbytes, delay us); a DATA payload is at
most FRAME_BYTES, so a receiver's buffer per connection is bounded whatever the header says.
`msg` numbers every message of one sender -> receiver direction; after a reconnect the sender
resends each unacknowledged message whole and the receiver ignores the pieces it already has.
"""

from __future__ import annotations

import heapq
import struct
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FRAME = struct.Struct("!BQqQQQII")
DATA, ACK, BYE = 1, 2, 3
FRAME_BYTES = 1 << 20                   # payload bytes per DATA frame
DEFAULT_MAX_MESSAGE_BYTES = 4 << 30     # without a plan: no single tensor above 4 GiB is accepted


class TransportError(RuntimeError):
    """A transfer failed: the link could not be restored in time, a size mismatch, or the peer left."""


def frame_payload(fields: tuple) -> int:
    kind, _msg, _tag, _seq, _total, _offset, nbytes, _delay = fields
    return nbytes if kind == DATA else 0


class Work:
    """Completion handle; `wait()` blocks, re-raises a transfer error, returns True.

    While it waits longer than `stall_s` it says so on stderr, naming the transfer, once per
    `stall_s`; after `timeout_s` it raises. `finished_at` (wall clock) is when the last byte left
    the sender (a send) or when the message was complete (a recv); `started_at`, of a send, when it
    entered the link (its turn granted, the messages before it to that peer gone)."""

    def __init__(self, what: str, timeout_s: float, stall_s: float = 30.0, say=None):
        self.what = what
        self.timeout_s = timeout_s
        self.stall_s = stall_s
        self.say = say
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.finished_at: float | None = None
        self.started_at: float | None = None

    def _finish(self, error: BaseException | None = None, at: float | None = None) -> None:
        if self._done.is_set():
            return
        self._error = error
        self.finished_at = at if at is not None else time.time()
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        limit = self.timeout_s if timeout is None else timeout
        start = time.monotonic()
        while not self._done.is_set():
            left = limit - (time.monotonic() - start)
            if left <= 0:
                raise TransportError(f"{self.what}: timed out after {limit:.0f} s (did the peer rank stop?)")
            if self._done.wait(min(left, self.stall_s)):
                break
            waited = time.monotonic() - start
            if self.say is not None and waited < limit:
                self.say(f"{self.what}: no progress for {waited:.0f} s, still waiting (gives up after {limit:.0f} s)")
        if self._error is not None:
            raise TransportError(f"{self.what}: {self._error}") from self._error
        return True


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (any dtype, bf16 included), without a copy."""
    import torch  # here, not at the top: `geotrain plan` reads transport.turns and must not import torch (~1 s CPU)

    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def chunks(nbytes: int, k: int, min_chunk: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of up to k near-equal contiguous pieces, none smaller than min_chunk."""
    n = max(1, min(k, nbytes // max(1, min_chunk)))
    bounds = [nbytes * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(n)]


class IdSet:
    """Message ids seen so far, kept as a floor (every id below it) plus the few above it."""

    def __init__(self) -> None:
        self.floor = 0
        self.above: set[int] = set()

    def add(self, i: int) -> None:
        self.above.add(i)
        while self.floor in self.above:
            self.above.remove(self.floor)
            self.floor += 1

    def __contains__(self, i: int) -> bool:
        return i < self.floor or i in self.above


class Countdown:
    """Waits for n writer-thread results; keeps the first error."""

    def __init__(self, n: int):
        self.n = n
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def tick(self, error: BaseException | None = None) -> None:
        with self.cond:
            self.n -= 1
            self.error = self.error or error
            self.cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.n <= 0, timeout)


class DueTimers:
    """Calls `fn(*args)` at a monotonic due time, on one thread (the shaper's one-way delay)."""

    def __init__(self, name: str):
        self._heap: list = []
        self._cv = threading.Condition()
        self._seq = 0
        self._closed = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def at(self, due: float, fn, *args) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._heap, (due, self._seq, fn, args))
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait(1.0)
                if self._closed:
                    return
                due, _, fn, args = self._heap[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                heapq.heappop(self._heap)
            fn(*args)


def store_get(store, key: str, timeout_s: float, what: str) -> str:
    """`store`'s value for `key`, waiting at most `timeout_s` for a peer to publish it; else a
    TransportError saying `what` was awaited (a peer's listening address, a link's arbiter) and why it
    may be missing, not the store's bare key timeout."""
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        raw = store.get(key)
    except TransportError:
        raise
    except Exception as e:  # noqa: BLE001 -- the store's timeout and connection errors alike
        raise TransportError(f"no {what} in the rendezvous store after {timeout_s:.0f} s ({type(e).__name__}): "
                             "that rank has not started its WAN transport -- it failed or is still starting "
                             "(--outage-limit bounds this wait)") from None
    return raw.decode() if isinstance(raw, bytes) else str(raw)
