"""User-space packet delayer: the WAN's propagation delay (this kernel has no netem).

Runs inside the router namespace (`python -m geotrain.emulation.delayer ...`): policy routing
sends every packet forwarded between DC namespaces into a TUN device; this process holds each one
for its link's one-way latency (with the link's loss and jitter, never reordering) and writes it
back, to be forwarded through the htb rate limits. One thread, `select` plus a heap: 1 Gbit/s of
64 KB packets is ~2k packets/s. It exits when its lifetime ends or its owner dies, tearing the
whole emulation down, so a crash never leaves traffic black-holed behind a dead delayer.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import random
import select
import signal
import struct
import sys
import time
from pathlib import Path

from geotrain.emulation.netns import WanState, teardown

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_HELD_BYTES = 512 * 2**20   # drop (like a full router buffer) rather than grow without bound


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


class LinkTable:
    """(source subnet octet, destination subnet octet) -> (delay s, jitter s, loss)."""

    def __init__(self, links: list[dict]):
        self.table: dict[tuple[int, int], tuple[float, float, float]] = {}
        for ln in links:
            a, b = int(ln["a"]), int(ln["b"])
            v = (ln["latency_ms"] / 1e3, ln.get("jitter_ms", 0.0) / 1e3, ln.get("loss", 0.0))
            self.table[(a, b)] = v
            self.table[(b, a)] = v

    def lookup(self, pkt: bytes) -> tuple[tuple[int, int], tuple[float, float, float]] | None:
        if len(pkt) < 20 or pkt[0] >> 4 != 4:
            return None
        key = (pkt[14], pkt[18])      # third octet of 10.77.X.Y source and destination
        v = self.table.get(key)
        return (key, v) if v is not None else None


def serve(fd: int, links: LinkTable, stop_at: float, owner_pid: int | None, rng: random.Random) -> str:
    """Delay packets until stopped; returns why it stopped."""
    heap: list[tuple[float, int, bytes]] = []
    last_out: dict[tuple[int, int], float] = {}
    held = 0
    seq = 0
    next_owner_check = 0.0
    stopping = {"why": ""}

    def on_term(signum, frame):
        stopping["why"] = "signal"

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while not stopping["why"]:
        now = time.monotonic()
        if now >= next_owner_check:
            next_owner_check = now + 0.5
            if now >= stop_at:
                return "lifetime"
            if owner_pid is not None:
                try:
                    os.kill(owner_pid, 0)
                except ProcessLookupError:
                    return "owner"
        timeout = min(0.5, max(0.0, heap[0][0] - now)) if heap else 0.5
        try:
            ready, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:
            continue
        if ready:
            now = time.monotonic()
            while True:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                hit = links.lookup(pkt)
                if hit is None or held + len(pkt) > MAX_HELD_BYTES:
                    continue
                key, (delay, jitter, loss) = hit
                if loss and rng.random() < loss:
                    continue
                due = now + delay + (rng.random() * jitter if jitter else 0.0)
                if jitter:
                    due = max(due, last_out.get(key, 0.0))
                    last_out[key] = due
                heapq.heappush(heap, (due, seq, pkt))
                seq += 1
                held += len(pkt)
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, _, pkt = heapq.heappop(heap)
            held -= len(pkt)
            try:
                os.write(fd, pkt)
            except OSError:
                pass     # e.g. destination unreachable for a moment: a lost packet, as on a WAN
    return stopping["why"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tun", required=True)
    ap.add_argument("--links", required=True, help="JSON list of {a, b, latency_ms, jitter_ms, loss}")
    ap.add_argument("--lifetime", type=float, default=3600.0, help="seconds before it stops and tears down")
    ap.add_argument("--owner-pid", type=int, default=None)
    ap.add_argument("--state", default=None, help="state file to tear down when the owner dies or time is up")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    fd = open_tun(a.tun)
    try:        # the delayer is the emulated network: busy training processes must not starve it
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except OSError:
        pass
    print("ready", flush=True)
    why = serve(fd, LinkTable(json.loads(a.links)), time.monotonic() + a.lifetime, a.owner_pid,
                random.Random(a.seed))
    os.close(fd)
    if why in ("owner", "lifetime") and a.state:

        try:
            print(f"geotrain wan delayer: {why} ended; tearing the emulation down", file=sys.stderr, flush=True)
        except OSError:
            pass                     # nobody reads our stderr any more: tear down all the same
        try:
            teardown(WanState.load(Path(a.state)), kill_delayer=False)
        except FileNotFoundError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
