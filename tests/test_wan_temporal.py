"""Temporal link sharing: pipelines take turns one transfer at a time, in the plan's cyclic order
among those waiting, never waiting for one that has nothing ready (work-conserving); over TCP
(arbiter service) and inside StripedTransport; fair sharing as the no-op baseline."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from geotrain.emulation.user_shaper import ShaperConfig
from geotrain.transport.striped import StripedTransport
from geotrain.transport.turns import FairSharing, LocalTurns, TurnArbiter, TurnTimeout, turns_via_store


def _run_pipelines(make_turns, order, sends_each=4, hold_s=0.01):
    """Each pipeline thread does `sends_each` transfers, holding the link `hold_s` per transfer;
    returns the (pipeline, start, end) intervals."""
    log, lock = [], threading.Lock()

    def pipeline(key):
        t = make_turns(key)
        for _ in range(sends_each):
            t.acquire()
            start = time.monotonic()
            time.sleep(hold_s)
            with lock:
                log.append((key, start, time.monotonic()))
            t.release()

    threads = [threading.Thread(target=pipeline, args=(k,)) for k in reversed(order)]   # start out of order
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    return sorted(log, key=lambda x: x[1])


def _no_overlap(log) -> bool:
    return all(a[2] <= b[1] + 1e-4 for a, b in zip(log, log[1:]))


def _cyclic(keys, order) -> bool:
    """Every grant after the first goes to the next pipeline in `order` (all are waiting then)."""
    n = len(order)
    return all(order[(order.index(a) + 1) % n] == b for a, b in zip(keys, keys[1:]))


def test_in_process_turns_follow_the_order_one_at_a_time():
    arb = TurnArbiter([2, 0, 1])
    log = _run_pipelines(lambda k: LocalTurns(arb, k), [2, 0, 1])
    keys = [k for k, _, _ in log]
    assert sorted(keys) == sorted([2, 0, 1] * 4)
    assert _cyclic(keys, [2, 0, 1])
    assert _no_overlap(log)


def test_remote_turns_over_tcp():
    store = dist.HashStore()
    arbiters = []

    def make(key):
        client, arb = turns_via_store(store, "east->west", key, [0, 1, 2], host="127.0.0.1", is_host=key == 0)
        if arb is not None:
            arbiters.append(arb)
        return client

    log = _run_pipelines(make, [0, 1, 2], sends_each=3)
    keys = [k for k, _, _ in log]
    assert sorted(keys) == sorted([0, 1, 2] * 3)
    assert _no_overlap(log)
    arbiters[0].close()


def test_a_ready_pipeline_never_waits_for_an_idle_turn():
    """Pipeline 1's turn, but it has nothing to send: pipeline 0 gets the link at once (strict
    turns kept the link idle and timed out here)."""
    arb = TurnArbiter([0, 1], timeout_s=0.5)
    arb.acquire(0)
    arb.release(0)
    t0 = time.monotonic()
    arb.acquire(0)
    assert time.monotonic() - t0 < 0.1
    arb.release(0)
    assert arb.grants == [0, 0]


def test_slots_let_several_transfers_fill_the_link_and_timeouts_name_the_holders():
    arb = TurnArbiter([0, 1, 2], timeout_s=0.3, slots=2)
    arb.acquire(0)
    arb.acquire(1)                      # a second slot: both hold the link
    with pytest.raises(TurnTimeout, match=r"held by pipeline\(s\) \[0, 1\]"):
        arb.acquire(2)
    arb.release(0)
    arb.acquire(2)
    arb.leave(1)
    arb.release(2)
    assert arb.grants == [0, 1, 2]


def test_a_send_is_done_only_once_its_turn_is_released():
    """The receiver's ACK comes on another thread than the turn's release: when it came first (the
    dispatcher descheduled in between, as under load), the Work completed with the turn still
    held -- the caller saw its sends done, then counted one turn fewer than it took."""
    store = dist.HashStore()
    arb = TurnArbiter([0])
    released = []

    class SlowRelease(LocalTurns):
        def release(self):
            time.sleep(0.3)             # the ACK is back long before this
            released.append(self.key)
            super().release()

    send = StripedTransport(0, store, turns=lambda dst: SlowRelease(arb, 0))
    recv = StripedTransport(1, store)
    try:
        x, y = torch.randn(1000), torch.empty(1000)
        wr = recv.recv(y, 0, 0)
        send.send(x, 1, 0).wait()
        assert released == [0]          # done means the turn is free again
        wr.wait()
        assert torch.equal(x, y) and arb.holders == []
    finally:
        send.close()
        recv.close()


def test_concurrent_turns_fill_the_link():
    from geotrain.transport.turns import concurrent_turns

    assert concurrent_turns(10.0, 10.0) == 1 and concurrent_turns(10.0, 20.0) == 1
    assert concurrent_turns(10.0, 2.5) == 4 and concurrent_turns(10.0, 3.0) == 4


def test_fair_sharing_overlaps():
    log = _run_pipelines(lambda k: FairSharing(), [0, 1, 2], sends_each=2, hold_s=0.05)
    assert not _no_overlap(log)


def test_striped_transport_consults_turns_around_each_send():
    """Two senders to one receiver: with turns their transfers never overlap."""
    store = dist.HashStore()
    arb = TurnArbiter([1, 0])
    intervals, lock = [], threading.Lock()

    class Recording(LocalTurns):
        def acquire(self):
            super().acquire()
            self.t = time.monotonic()

        def release(self):
            with lock:
                intervals.append((self.key, self.t, time.monotonic()))
            super().release()

    shaper = ShaperConfig(per_connection_gbps=0.2)
    senders = [StripedTransport(r, store, connections=2, shaper=shaper, turns=lambda dst, r=r: Recording(arb, r))
               for r in (0, 1)]
    recv = StripedTransport(2, store)
    try:
        x = torch.randn(3, 50_000)                      # 600 kB: ~12 ms at 0.4 Gbit/s
        outs = {(r, i): torch.empty(50_000) for r in (0, 1) for i in range(3)}
        works = [recv.recv(o, r, i) for (r, i), o in outs.items()]
        works += [s.send(x[i], 2, i) for i in range(3) for s in senders]
        for w in works:
            w.wait()
        assert all(torch.equal(outs[(r, i)], x[i]) for r, i in outs)
        intervals.sort(key=lambda v: v[1])
        assert sorted(k for k, _, _ in intervals) == [0, 0, 0, 1, 1, 1]
        assert _no_overlap(intervals)
    finally:
        for s in [*senders, recv]:
            s.close()
