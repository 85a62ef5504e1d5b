"""StripedTransport over loopback (no root): exact reassembly, ordering, size checks, and the
user-space shaper's caps and delay (the no-root fallback)."""

from __future__ import annotations

import struct
import time

import pytest
import torch
import torch.distributed as dist

from geotrain.emulation.user_shaper import ShaperConfig
from geotrain.transport.striped import FRAME, StripedTransport, TransportError


@pytest.fixture
def pair():
    store = dist.HashStore()
    a = StripedTransport(0, store, connections=4, min_chunk_bytes=256, timeout_s=20)
    b = StripedTransport(1, store, connections=4, min_chunk_bytes=256, timeout_s=20)
    yield a, b, store
    a.close()
    b.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_random_tensors_of_odd_sizes_arrive_exactly(pair, dtype):
    a, b, _ = pair
    gen = torch.Generator().manual_seed(1)
    for shape in [(0,), (1,), (7,), (3, 5, 7), (1001,), (65_537,), (123, 4567)]:
        x = (torch.randn(shape, generator=gen) * 1000).to(dtype)
        y = torch.full_like(x, 3)
        ws, wr = a.send(x, 1, tag=11), b.recv(y, 0, tag=11)
        ws.wait()
        wr.wait()
        assert torch.equal(x, y), shape


def test_recv_posted_late_and_noncontiguous_target(pair):
    a, b, _ = pair
    x = torch.randn(40, 30)
    a.send(x, 1, tag=2).wait()
    time.sleep(0.05)                                       # the bytes wait in a buffer for the recv
    y = torch.empty(30, 40).t()
    b.recv(y, 0, tag=2).wait()
    assert torch.equal(x, y)


def test_messages_of_one_tag_keep_order_and_tags_are_independent(pair):
    a, b, _ = pair
    xs = [torch.full((5000,), float(i)) for i in range(6)]
    ys = [torch.empty(5000) for _ in range(6)]
    # receive tag 1 before tag 0 is even sent
    recvs = [b.recv(ys[i], 0, tag=i % 2) for i in (1, 3, 5, 0, 2, 4)]
    sends = [a.send(x, 1, tag=i % 2) for i, x in enumerate(xs)]
    for w in sends + recvs:
        w.wait()
    assert all(torch.equal(x, y) for x, y in zip(xs, ys))


def test_both_directions_at_once(pair):
    a, b, _ = pair
    x, y = torch.randn(100_000), torch.randn(77_777)
    gx, gy = torch.empty_like(x), torch.empty_like(y)
    ws = [a.send(x, 1, 0), b.send(y, 0, 0), b.recv(gx, 0, 0), a.recv(gy, 1, 0)]
    for w in ws:
        w.wait()
    assert torch.equal(x, gx) and torch.equal(y, gy)


def test_size_mismatch_is_an_error(pair):
    a, b, _ = pair
    a.send(torch.zeros(10), 1, tag=4)
    with pytest.raises(TransportError, match="size mismatch"):
        b.recv(torch.zeros(11), 0, tag=4).wait(timeout=10)


def test_frames_are_a_fixed_struct_not_pickle():
    assert FRAME.size == struct.calcsize("!BQqQQQII")


def _timed_transfer(k: int, shaper: ShaperConfig, nbytes: int, base: int) -> tuple[float, float]:
    """(wall seconds, seconds by the shaper's booking: until its connections' last blocks were due
    to leave) for one transfer of `nbytes` over `k` shaped connections."""
    store = dist.HashStore()
    a = StripedTransport(base, store, connections=k, shaper=shaper)
    b = StripedTransport(base + 1, store)
    try:
        warm = torch.zeros(1)
        wr = b.recv(torch.empty(1), base, 0)
        a.send(warm, base + 1, 0).wait()
        wr.wait()                                           # connections are up: time only the transfer
        x = torch.randn(nbytes // 4)
        y = torch.empty_like(x)
        t = time.monotonic()
        wr = b.recv(y, base, 1)
        a.send(x, base + 1, 1).wait()
        wr.wait()
        dt = time.monotonic() - t
        assert torch.equal(x, y)
        booked = [lane.pacing.last for lane in a._peers[base + 1].lanes if lane.pacing and lane.pacing.last]
        return dt, (max(booked) - t if booked else dt)
    finally:
        a.close()
        b.close()


def _best_of(tries: int, measure, good):
    """Load only slows a transfer (late wake-ups past the shaper's catch-up), never speeds it up: a
    loaded 2-core machine's first try may come out slow, so up to `tries` are made and the first
    `good` one returned (else the last). Every try is returned too, for the hard upper bounds."""
    seen = []
    for _ in range(tries):
        seen.append(measure())
        if good(seen[-1]):
            break
    return seen[-1], seen


def test_shaper_caps_each_connection_and_the_aggregate():
    """The caps by the shaper's own booking (a loaded CPU's late wake-ups within a transfer are
    made up, up to CATCH_UP_S each, so this holds under moderate load; past that, another try), and
    by the wall clock from the side load cannot push: never faster than the cap, never done before
    the booking said -- on every try."""
    cfg = ShaperConfig(per_connection_gbps=0.08, aggregate_gbps=0.2)
    nbytes = 3_000_000                                     # 24 Mbit
    for k, expect_gbps in [(1, 0.08), (4, 0.2)]:
        def rate(booked: float) -> float:
            return nbytes * 8 / booked / 1e9

        (dt, booked), tries = _best_of(3, lambda k=k: _timed_transfer(k, cfg, nbytes, base=10 * k),
                                       lambda m, e=expect_gbps: abs(rate(m[1]) - e) <= 0.15 * e)
        assert abs(rate(booked) - expect_gbps) <= 0.15 * expect_gbps, (k, [rate(b) for _, b in tries])
        for dt, booked in tries:
            assert nbytes * 8 / dt / 1e9 <= 1.15 * expect_gbps, (k, dt)
            assert dt >= booked - 1e-3, (k, dt, booked)


def test_shaper_adds_one_way_delay():
    """Never before the delay (every try); not much after it on a try the machine's load did not hold up."""
    (dt, _), tries = _best_of(3, lambda: _timed_transfer(2, ShaperConfig(delay_ms=60), 4000, base=50),
                              lambda m: m[0] <= 0.09)
    assert all(t >= 0.055 for t, _ in tries), tries
    assert dt <= 0.09, tries
