"""Temporal <= fair in a real emulated run (root only): d = 2, 4, 8 pipelines on one saturated link.

The kernel emulation (namespaces, packet delayer, htb caps), StripedTransport with 4 connections
per transfer and RemoteTurns over TCP -- the runtime's WAN path -- with compute emulated by sleeps
(`calibrate.link_sharing` says why). Every micro-batch round puts d transfers of 105 ms / d each
(at the link's 10 Mbit/s) on the link, each way, against 75 ms of compute: saturated for every d.

Tolerance: 5%. Under the load of other jobs on this 2-core machine (load average 5-10), fair
iterations of one case spread by -17..+22% around their median over 5 rounds, temporal ones by
-13..+11% (`bench/bench_rehearse.py --sharing`, 2026-12-01); the simulator puts temporal 21-34%
below fair here and the runtime measured 16-29% below. With turns handed on at
the last write (the runtime before) d=8 measured temporal 17% above fair and every turn was held
0.5 ms for a 52 ms transfer.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

CAPACITY_GBPS, LATENCY_MS, CONNECTIONS = 0.01, 10.0, 4
ROUND_BYTES = 131072           # d transfers per micro-batch round, 105 ms at 10 Mbit/s (>= 4 x 4 KiB each)
FORWARD_S, BACKWARD_S = 0.025, 0.05
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def rows():
    from geotrain.calibrate.link_sharing import PipelineCase, link_cluster, measure

    cluster = link_cluster(CAPACITY_GBPS, CAPACITY_GBPS / CONNECTIONS, LATENCY_MS)
    cases = [PipelineCase(d, 3, FORWARD_S, BACKWARD_S, ROUND_BYTES // d, CONNECTIONS) for d in (2, 4, 8)]
    got = measure(cases, cluster, rounds=3)
    return cluster, {(r["case"].d, r["sharing"]): r for r in got}


@pytest.mark.parametrize("d", [2, 4, 8])
def test_temporal_is_not_slower_than_fair_measured_and_simulated(rows, d):
    from geotrain.calibrate.link_sharing import simulated

    cluster, by = rows
    fair, temporal = by[(d, "fair")], by[(d, "temporal")]
    assert simulated(temporal["case"], "temporal", cluster) <= simulated(fair["case"], "fair", cluster) * (1 + 1e-9)
    assert temporal["iteration_s"] <= fair["iteration_s"] * (1 + TOLERANCE), (
        f"d={d}: temporal {temporal['iterations']} vs fair {fair['iterations']} s per iteration")


def test_each_turn_holds_the_link_for_its_transfer(rows):
    """A turn handed on when its bytes were written, not when they left the network's queue, is
    fair sharing with extra round trips: held ~1 ms for a 40 ms transfer (the runtime before)."""
    import statistics

    _, by = rows
    for d in (2, 4, 8):
        r = by[(d, "temporal")]
        full_rate = r["case"].nbytes / (CAPACITY_GBPS * 1e9 / 8)
        assert len(r["turn_held_s"]) == 2 * d * 3 * 3         # both directions, every micro-batch, 3 rounds
        assert statistics.median(r["turn_held_s"]) >= 0.8 * full_rate, (d, statistics.median(r["turn_held_s"]))
        assert not by[(d, "fair")]["turn_held_s"]
