"""Pieces of the WAN emulation that need no root: htb layout, source-port buckets, names,
and the non-root fallback decision."""

from __future__ import annotations

import socket

import pytest

from geotrain.emulation import netns as N
from geotrain.emulation.htb import BUCKETS, bucket_of_port, htb_commands
from geotrain.emulation.ports import spread_port_connections as open_connections
from geotrain.spec import Cluster


def _cluster():
    return Cluster.model_validate({
        "datacenters": [{"name": "east-coast", "gpu_type": "cpu", "gpus": 1},
                        {"name": "west", "gpu_type": "cpu", "gpus": 1},
                        {"name": "eu", "gpu_type": "cpu", "gpus": 1}],
        "wan_links": [{"between": ["east-coast", "west"], "latency_ms": 30, "capacity_gbps": 0.4,
                       "per_connection_gbps": 0.1},
                      {"between": ["west", "eu"], "latency_ms": 70, "capacity_gbps": 0.2, "per_connection_gbps": 0.05}],
    })


def test_htb_layout_has_distinct_classes_and_one_filter_per_bucket():
    cmds = htb_commands("gtd1", [(0, "10.77.1.0/24", 0.4, 0.1), (2, "10.77.3.0/24", 0.2, 0.05)], mtu=65000)
    classids = [c[c.index("classid") + 1] for c in cmds if c[0] == "class"]
    assert len(classids) == len(set(classids)) == 2 * (1 + BUCKETS + 1)
    tcp_filters = [c for c in cmds if c[0] == "filter" and "sport" in c]
    assert len(tcp_filters) == 2 * BUCKETS
    parents = [c for c in cmds if c[0] == "class" and c[5] == "1:"]
    assert [p[p.index("ceil") + 1] for p in parents] == ["400000000bit", "200000000bit"]


def test_striped_connections_land_in_distinct_port_buckets():
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)
    socks = open_connections("127.0.0.1", ls.getsockname()[1], 8)
    buckets = {bucket_of_port(s.getsockname()[1]) for s in socks}
    assert len(buckets) == 8
    # Two ranks of one DC (DP replicas over the same link) with their own first buckets never share
    # a per-connection cap.
    other = open_connections("127.0.0.1", ls.getsockname()[1], 1, first_bucket=8)
    assert bucket_of_port(other[0].getsockname()[1]) not in buckets
    for s in socks + other:
        s.close()
    ls.close()


def test_namespace_and_interface_names_fit_linux_limits():
    tag = "abc123"
    for i, dc in enumerate(["east-coast", "a" * 80, "ü"]):
        ns = N.dc_ns(tag, i, dc)
        assert ns.startswith(f"gt-{tag}-") and len(ns) <= 32 and "/" not in ns
    assert len(N.router_ifname(254)) <= 15 and len(N.TUN_IFNAME) <= 15


def test_not_root_means_no_kernel_emulation_and_the_fallback_shapes_cross_dc_pairs(monkeypatch):
    from geotrain.emulation import fallback
    from geotrain.emulation import network as emulation

    monkeypatch.setattr(emulation.os, "geteuid", lambda: 1000)
    assert emulation.emulation_available() == (False, "not root")
    dcs = {0: "east-coast", 1: "west", 2: "eu", 3: "eu"}
    shaper = fallback.fallback_shaper(_cluster(), dcs.__getitem__, "west")
    assert shaper(0).delay_ms == 30 and shaper(0).per_connection_gbps == pytest.approx(0.1)
    assert shaper(2).aggregate_gbps == pytest.approx(0.2)
    eu = fallback.fallback_shaper(_cluster(), dcs.__getitem__, "eu")
    assert eu(3) is None and eu(0) is None          # same DC; no link east-coast-eu


def test_packets_and_burst_are_small_enough_that_htb_paces_a_message_at_its_cap():
    from geotrain.emulation.htb import emulation_mtu

    # htb sends a packet whenever its class has credit and charges it after: a message must span
    # many packets, and the burst must hold little, or a 16 KB tensor crosses a 5 Mbit/s cap at once.
    slow, fast = 0.005, 0.25                      # Gbit/s per connection
    mtu = emulation_mtu([fast, slow])
    assert mtu <= 2000                             # ~1 ms at 5 Mbit/s (floor 1280)
    assert emulation_mtu([1.0]) == 65000 and emulation_mtu([]) == 65000
    cmds = htb_commands("gtd1", [(0, "10.77.1.0/24", 1.0, slow)], mtu=mtu)
    leaf = next(c for c in cmds if c[0] == "class" and c[5] != "1:")
    burst_s = int(leaf[leaf.index("burst") + 1]) / (slow * 1e9 / 8)
    assert burst_s <= 0.003                        # a 16 KB message takes its 26 ms, less at most 3 ms
