"""User-space WAN shaping inside the project's own transport: the fallback where the kernel
emulation is impossible (not root), and a deterministic tool for unit tests.

Pacing is a virtual clock per connection and one shared by a shaper's connections (the
aggregate), each advanced by B / rate per block of B bytes, so K connections reach
min(K * per_connection, aggregate) like K window-limited TCP connections. A block leaves when its
last byte would have left a link of that rate (`ShaperConfig.exact`, the default; `exact=False`
allows 128 KB of burst credit, too fast for lone messages: docs/DECISIONS.md), so a message
arrives B / rate + delay after it was sent, as the simulator charges it. The receiver applies the
one-way delay. Limits: the aggregate is per sending process, and only StripedTransport's traffic
is shaped -- gloo collectives are not.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

BLOCK = 64 << 10            # pacing granularity (bytes)
CATCH_UP_S = 0.05           # how late a following block's thread may wake and still be booked back-to-back


@dataclass(frozen=True)
class ShaperConfig:
    per_connection_gbps: float | None = None
    aggregate_gbps: float | None = None
    delay_ms: float = 0.0
    exact: bool = True          # a block leaves when its last byte would have (see module docstring)

    @property
    def active(self) -> bool:
        return bool(self.per_connection_gbps or self.aggregate_gbps or self.delay_ms)

    def pacing(self) -> Shaper:
        """StripedTransport's pacing hook: one Shaper per (sender, destination)."""
        return Shaper(self)


def shaper_for_link(link, rate_scale: float = 1.0, exact: bool = True) -> ShaperConfig:
    """The fallback shaping for one WanLink (geotrain.spec.WanLink)."""
    return ShaperConfig(per_connection_gbps=link.per_connection_gbps * rate_scale,
                        aggregate_gbps=link.capacity_gbps * rate_scale, delay_ms=link.latency_ms, exact=exact)


class Pacer:
    """A virtual-clock rate limit with a small burst allowance; thread-safe."""

    def __init__(self, gbps: float, burst_bytes: int = 2 * BLOCK):
        self.bytes_per_s = gbps * 1e9 / 8
        self.burst_s = burst_bytes / self.bytes_per_s
        self.next = 0.0
        self.lock = threading.Lock()

    def reserve(self, nbytes: int, not_before: float) -> float:
        """Book `nbytes` no earlier than `not_before`; returns when they may start."""
        with self.lock:      # GCRA: `next` is the theoretical arrival time of the next byte
            tat = max(self.next, not_before)
            self.next = tat + nbytes / self.bytes_per_s
            return max(not_before, tat - self.burst_s)

    def finish(self, nbytes: int, not_before: float) -> float:
        """Book `nbytes` no earlier than `not_before`; returns when their last byte has left (no burst)."""
        with self.lock:
            self.next = max(self.next, not_before) + nbytes / self.bytes_per_s
            return self.next


class ConnectionShaper:
    """Paces one connection under its own cap and its shaper's shared aggregate cap."""

    def __init__(self, config: ShaperConfig, aggregate: Pacer | None):
        self.config = config
        self.own = Pacer(config.per_connection_gbps) if config.per_connection_gbps else None
        self.aggregate = aggregate
        self.last: float | None = None      # when the previous block left (exact) or could start (burst)

    def wait_for(self, nbytes: int, follows: bool = False) -> None:
        """Hold the caller until `nbytes` may leave. `follows`: the block comes right after this
        connection's previous one in the same transfer -- it was ready when that one left, so it is
        booked from then, not from whenever this thread woke. (A late wake-up on a loaded CPU is not
        idle link time: booked from the wake-up, 3 MB at 80 Mbit/s came out at 66 Mbit/s under load.)
        At most CATCH_UP_S is made up: a longer gap is a stall (a full receive window) that idles a
        real link too."""
        now = time.monotonic()
        start = now
        if follows and self.last is not None:
            start = min(now, max(self.last, now - CATCH_UP_S))
        ready = start
        if self.config.exact:
            # Each clock serializes the block from when it is free; the block has left when every
            # clock says so (the binding cap decides; a cap far above the other costs nothing).
            for pacer in (self.own, self.aggregate):
                if pacer is not None:
                    start = max(start, pacer.finish(nbytes, ready))
        else:
            if self.own is not None:
                start = self.own.reserve(nbytes, start)
            if self.aggregate is not None:
                start = self.aggregate.reserve(nbytes, start)
        self.last = start
        delay = start - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class Shaper:
    """One per (sender, destination): hands out paced connections sharing the aggregate cap."""

    def __init__(self, config: ShaperConfig):
        self.config = config
        self.aggregate = Pacer(config.aggregate_gbps) if config.aggregate_gbps else None

    def connection(self) -> ConnectionShaper:
        return ConnectionShaper(self.config, self.aggregate)
