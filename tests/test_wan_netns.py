"""The emulated WAN with real kernel networking (root only): latency, per-connection and link caps,
striped transfers across DC namespaces, tear-down, stale-run cleanup, delayer watchdog.

Rates are kept modest (50 Mbit/s per connection) so the Python delayer is never the bottleneck.
Run as a script (`python tests/test_wan_netns.py peer ...`) it is the striped-transport peer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

PY = sys.executable
LATENCY_MS = 20.0
CAP_GBPS = 0.05
LINK_GBPS = 0.12


def _cluster(latency_ms=LATENCY_MS, cap=CAP_GBPS, link=LINK_GBPS):
    from geotrain.spec import Cluster

    return Cluster.model_validate({
        "name": "wan-test",
        "datacenters": [{"name": "east", "gpu_type": "cpu", "gpus": 1}, {"name": "west", "gpu_type": "cpu", "gpus": 1}],
        "wan_links": [{"between": ["east", "west"], "latency_ms": latency_ms, "capacity_gbps": link,
                       "per_connection_gbps": cap}],
    })


@pytest.fixture(scope="module")
def wan():
    from geotrain.emulation import WanEmulation

    with WanEmulation(_cluster()) as w:
        yield w


@pytest.fixture(scope="module")
def probe_secret(tmp_path_factory):
    from geotrain.emulation.probe import probe_env

    return probe_env(tmp_path_factory.mktemp("probe"))


@pytest.fixture(scope="module")
def probe_port(wan, probe_secret):
    srv = wan.popen("west", [PY, "-m", "geotrain.emulation.probe", "serve", "--host", wan.address("west")],
                    stdout=subprocess.PIPE, text=True, env=probe_secret)
    return int(srv.stdout.readline().split()[1])


def _probe(wan, probe_secret, *args) -> dict:
    r = wan.exec_in("east", [PY, "-m", "geotrain.emulation.probe", *args, "--host", wan.address("west")], timeout=60,
                    env=probe_secret)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_rtt_matches_configured_latency(wan, probe_port, probe_secret):
    rtt = _probe(wan, probe_secret, "ping", "--port", str(probe_port))["rtt_ms"]
    assert abs(rtt - 2 * LATENCY_MS) <= 0.1 * 2 * LATENCY_MS, rtt


def test_one_connection_is_capped_and_n_connections_reach_the_link(wan, probe_port, probe_secret):
    common = ["--port", str(probe_port), "--seconds", "3", "--warmup", "1.0"]
    one = _probe(wan, probe_secret, "send", "--connections", "1", *common)["gbps"]
    four = _probe(wan, probe_secret, "send", "--connections", "4", *common)["gbps"]
    link = _cluster().wan_links[0]
    assert abs(one - link.rate_gbps(1)) <= 0.15 * link.rate_gbps(1), one
    assert abs(four - link.rate_gbps(4)) <= 0.15 * link.rate_gbps(4), four      # min(4 * 50, 120) Mbit/s


def test_striped_transport_reassembles_exactly_across_namespaces(wan, tmp_path):
    """Rank 0 in east sends random tensors of odd sizes over 4 connections to rank 1 in west."""
    port = 29611
    common = ["--store-host", wan.address("east"), "--store-port", str(port), "--bind-west", wan.address("west"),
              "--bind-east", wan.address("east")]
    recv = wan.popen("west", [PY, __file__, "peer", "--rank", "1", *common], stdout=subprocess.PIPE, text=True)
    send = wan.popen("east", [PY, __file__, "peer", "--rank", "0", *common], stdout=subprocess.PIPE, text=True)
    out_send, _ = send.communicate(timeout=60)
    out_recv, _ = recv.communicate(timeout=60)
    assert send.returncode == 0 and recv.returncode == 0, (out_send, out_recv)
    res = json.loads(out_recv.strip().splitlines()[-1])
    assert res["all_equal"] and res["messages"] == 6, res


def test_teardown_leaves_nothing_and_watchdog_restarts_a_dead_delayer(probe_secret):
    from geotrain.emulation import WanEmulation
    from geotrain.emulation.netns import existing_namespaces, process_alive

    with WanEmulation(_cluster(latency_ms=5)) as w:
        names = set(w.state.all_namespaces())
        assert names <= existing_namespaces()
        sleeper = w.popen("east", ["sleep", "300"])
        old = w.delayer.pid
        os.kill(old, signal.SIGKILL)
        deadline = time.time() + 5
        while time.time() < deadline and (w.delayer.pid == old or not w.delayer_alive()):
            time.sleep(0.05)
        assert w.delayer_alive() and w.delayer.pid != old
        srv = w.popen("west", [PY, "-m", "geotrain.emulation.probe", "serve", "--host", w.address("west")],
                      stdout=subprocess.PIPE, text=True, env=probe_secret)
        p = srv.stdout.readline().split()[1]
        r = w.exec_in("east", [PY, "-m", "geotrain.emulation.probe", "ping", "--host", w.address("west"), "--port", p,
                               "--count", "5"], timeout=30, env=probe_secret)
        assert r.returncode == 0 and json.loads(r.stdout)["rtt_ms"] >= 9.5, r.stderr
        delayer_pid, state_path = w.delayer.pid, w.state.path
    assert not (names & existing_namespaces())
    assert not state_path.exists()
    assert sleeper.poll() is not None
    assert not process_alive(delayer_pid)


def test_cli_up_status_down(tmp_path):
    spec = tmp_path / "c.toml"
    spec.write_text('[[datacenters]]\nname = "a"\ngpu_type = "cpu"\ngpus = 1\n'
                    '[[datacenters]]\nname = "b"\ngpu_type = "cpu"\ngpus = 1\n'
                    '[[wan_links]]\nbetween = ["a", "b"]\nlatency_ms = 3\ncapacity_gbps = 0.1\n'
                    'per_connection_gbps = 0.05\n')
    cli = [PY, "-m", "geotrain", "wan"]
    up = subprocess.run([*cli, "up", str(spec), "--lifetime", "60"], capture_output=True, text=True, timeout=60)
    try:
        assert up.returncode == 0, up.stderr
        ns = up.stdout.split("namespace ")[2].split(",")[0]                # the first DC's namespace
        st = subprocess.run([*cli, "status", str(spec)], capture_output=True, text=True, timeout=60)
        assert ": up;" in st.stdout and "delayer running" in st.stdout, st.stdout
        r = subprocess.run(["ip", "netns", "exec", ns, "getent", "hosts", "b"], capture_output=True, text=True)
        assert r.stdout.split()[0] == "10.77.2.2"
    finally:
        down = subprocess.run([*cli, "down", str(spec)], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and "removed" in down.stdout, down.stderr
    st = subprocess.run([*cli, "status", str(spec)], capture_output=True, text=True, timeout=60)
    assert "no WAN emulation" in st.stdout


CRASHER = """
import sys, time
from geotrain.spec import Cluster
from geotrain.emulation import WanEmulation
c = Cluster.model_validate_json(sys.argv[1])
w = WanEmulation(c).start()
s = w.popen(c.datacenters[0].name, ["sleep", "300"])
print(w.state.path, s.pid, flush=True)
time.sleep(300)
"""


def _crash(kill_delayer: bool):
    from geotrain.emulation.netns import WanState

    child = subprocess.Popen([PY, "-c", CRASHER, _cluster(latency_ms=1).model_dump_json()], stdout=subprocess.PIPE,
                             text=True)
    path, sleeper = child.stdout.readline().split()
    st = WanState.load(Path(path))
    if kill_delayer:
        os.kill(st.delayer_pid, signal.SIGKILL)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    return st, int(sleeper)


def _gone(st, sleeper: int) -> bool:
    from geotrain.emulation.netns import existing_namespaces, process_alive

    return not set(st.all_namespaces()) & existing_namespaces() and not st.path.exists() and not process_alive(sleeper)


def test_stale_setup_from_a_crashed_run_is_cleaned():
    """Owner and delayer both SIGKILLed: the next emulation (or `wan down`) finds the state file and cleans."""
    from geotrain.emulation.netns import clean_stale, existing_namespaces

    st, sleeper = _crash(kill_delayer=True)
    assert set(st.all_namespaces()) <= existing_namespaces()
    assert st.tag in clean_stale(verbose=False)
    assert _gone(st, sleeper)


def test_delayer_tears_down_when_its_owner_dies():
    st, sleeper = _crash(kill_delayer=False)
    deadline = time.time() + 8
    while time.time() < deadline and not _gone(st, sleeper):
        time.sleep(0.1)
    assert _gone(st, sleeper)


# ---------------------------------------------------------------------- striped-transport peer (script mode)
def _peer(argv: list[str]) -> int:
    import argparse

    import torch
    import torch.distributed as dist

    from geotrain.emulation.ports import spread_port_connections
    from geotrain.transport.striped import StripedTransport

    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int)
    ap.add_argument("--store-host")
    ap.add_argument("--store-port", type=int)
    ap.add_argument("--bind-east")
    ap.add_argument("--bind-west")
    a = ap.parse_args(argv)
    store = dist.TCPStore(a.store_host, a.store_port, 2, is_master=a.rank == 0, timeout=__import__("datetime")
                          .timedelta(seconds=30))
    host = a.bind_east if a.rank == 0 else a.bind_west
    tr = StripedTransport(a.rank, store, host=host, connections=4, min_chunk_bytes=1 << 10,
                          connect=spread_port_connections)
    gen = torch.Generator().manual_seed(7)
    sizes = [(0,), (1,), (3, 7), (1023,), (257, 129), (100_003,)]
    tensors = [torch.randn(s, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
               for i, s in enumerate(sizes)]
    if a.rank == 0:
        works = [tr.send(t, 1, tag=i % 2) for i, t in enumerate(tensors)]
        for w in works:
            w.wait()
        store.get("done")
        print(json.dumps({"sent": len(works)}))
    else:
        outs = [torch.empty_like(t) for t in tensors]
        works = [tr.recv(o, 0, tag=i % 2) for i, o in enumerate(outs)]
        for w in works:
            w.wait()
        store.set("done", "1")
        ok = all(torch.equal(x, y) for x, y in zip(tensors, outs))
        print(json.dumps({"all_equal": ok, "messages": len(outs)}))
    tr.close()
    return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "peer":
    from geotrain.process import exit_skipping_teardown

    exit_skipping_teardown(_peer(sys.argv[2:]))
