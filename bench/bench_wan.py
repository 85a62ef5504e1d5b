"""Benchmark: one cross-DC transfer over the emulated WAN with 1, 2, 4, 8 TCP connections,
measured side by side in one run, each beside the model's prediction (WanLink.rate_gbps(n) and
the one-way latency).

    sudo .venv/bin/python bench/bench_wan.py [--latency-ms 20] [--capacity-gbps 0.4] [--mib 16]

Two measurements per connection count:
  * raw TCP (the probe): steady-state receiver throughput of n parallel streams;
  * StripedTransport: wall time of one tensor striped over n connections, from `send` until the
    receiver has it all (the receiver acks with a 1-element tensor; the ack's one-way latency is
    subtracted), against latency + bytes / rate_gbps(n). Fresh connections per n, so TCP slow
    start is included, as it would be for the first transfer of a training step after idling.
The per-connection cap defaults to a quarter of the capacity, so 4 connections fill the link.

    sudo .venv/bin/python bench/bench_wan.py --security [--mib 64] [--wan-mib 16] [--reps 3]

The price of securing the transport: throughput with authentication on/off and TLS on/off, 1 and
4 connections, over loopback (the CPU cost that would cap a fast link) and over the emulated WAN
(kernel emulation, needs root; without it only loopback is measured), all in one table, each arm
beside plain TCP. Sender and receiver are two processes (on the WAN: in the two DCs' namespaces),
arms interleaved per round so load drifts hit them alike:
  * tcp          -- raw TCP striped over k sockets: authentication off, TLS off (the baseline);
  * tls          -- the same inside TLS 1.3 with the transport's own contexts (`transport.tls`): auth off, TLS on;
  * striped      -- StripedTransport: challenge-response, HMAC frames, ACKs, resend bookkeeping: auth on;
  * striped+tls  -- StripedTransport(tls=True), what `geotrain train --wan-tls` runs: both on.
Connections (and handshakes) are set up before the clock starts; a transfer ends when the receiver
has confirmed every byte (one one-way latency more on the WAN, for every arm alike).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

COUNTS = (1, 2, 4, 8)
PY = sys.executable


def _peer(a: argparse.Namespace) -> int:
    """Runs inside a DC namespace: rank 0 (east) sends, rank 1 (west) receives and acks."""
    import torch
    import torch.distributed as dist

    from geotrain.emulation.ports import spread_port_connections
    from geotrain.transport.striped import StripedTransport

    store = dist.TCPStore(a.store_host, a.store_port, 2, is_master=a.role == "send",
                          timeout=datetime.timedelta(seconds=60))
    numel = a.mib * 2**20 // 4
    results = []
    for k in COUNTS:
        me, peer = (100 * k, 100 * k + 1) if a.role == "send" else (100 * k + 1, 100 * k)
        tr = StripedTransport(me, store, host=a.host, connections=k, prefix=f"bench/{k}",
                              connect=spread_port_connections)
        for rep in range(a.reps):
            if a.role == "send":
                x = torch.randn(numel)
                ack = torch.empty(1)
                t = time.monotonic()
                w = tr.recv(ack, peer, tag=rep)
                tr.send(x, peer, tag=rep).wait()
                w.wait()
                results.append({"k": k, "rep": rep, "seconds": time.monotonic() - t})
            else:
                y = torch.empty(numel)
                tr.recv(y, peer, tag=rep).wait()
                tr.send(torch.ones(1), peer, tag=rep).wait()
        store.set(f"bench/done/{k}/{a.role}", "1")
        store.get(f"bench/done/{k}/{'recv' if a.role == 'send' else 'send'}")
        tr.close()
    print(json.dumps(results))
    return 0


ARMS = (("tcp", "off", "off"), ("tls", "off", "on"), ("striped", "on", "off"), ("striped+tls", "on", "on"))


def _raw_send(store, key: str, host: str, k: int, payload: memoryview, tls, connect) -> float:
    """Seconds to move `payload` striped over k fresh connections (optionally TLS), until every
    stripe's receiver said it has all of it. Connections (and TLS handshakes) are set up first."""
    import threading

    port = int(store.get(key).decode())
    socks = connect(host, port, k)
    if tls is not None:
        socks = [tls.client.wrap_socket(s, server_hostname=None) for s in socks]
    n = len(payload)
    parts = [(n * i // k, n * (i + 1) // k) for i in range(k)]

    def stripe(i: int) -> None:
        lo, hi = parts[i]
        socks[i].sendall((hi - lo).to_bytes(8, "big"))
        socks[i].sendall(payload[lo:hi])
        socks[i].recv(1)

    t = time.perf_counter()
    threads = [threading.Thread(target=stripe, args=(i,)) for i in range(k)]
    for x in threads:
        x.start()
    for x in threads:
        x.join()
    dt = time.perf_counter() - t
    for s in socks:
        s.close()
    return dt


def _raw_recv(store, key: str, host: str, k: int, tls) -> None:
    import socket
    import threading

    from geotrain.transport.sockets import recv_exact

    ls = socket.create_server((host, 0))
    store.set(key, str(ls.getsockname()[1]))

    def serve(conn) -> None:
        if tls is not None:
            conn = tls.server.wrap_socket(conn, server_side=True)
        head = bytearray(8)
        recv_exact(conn, memoryview(head))
        buf = memoryview(bytearray(1 << 20))
        left = int.from_bytes(head, "big")
        while left:
            got = conn.recv_into(buf, min(left, len(buf)))
            if not got:
                return
            left -= got
        conn.sendall(b"k")
        conn.close()

    threads = []
    for _ in range(k):
        c, _ = ls.accept()
        threads.append(threading.Thread(target=serve, args=(c,)))
        threads[-1].start()
    for x in threads:
        x.join()
    ls.close()


def _security_role(a: argparse.Namespace) -> int:
    """One side (send or recv) of every security arm, 1 and 4 connections, `reps` rounds interleaved
    (load drifts hit every arm alike); the sender prints [{arm, k, seconds}] as JSON."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    from geotrain.emulation.ports import spread_port_connections
    from geotrain.transport.sockets import open_connections
    from geotrain.transport.striped import StripedTransport
    from geotrain.transport.tls import RunTLS

    send = a.security_role == "send"
    store = dist.TCPStore(a.store_host, a.store_port, 2, is_master=send, timeout=dt.timedelta(seconds=120))
    if send:
        store.set("sec/secret", os.urandom(32).hex())
    secret = bytes.fromhex(store.get("sec/secret").decode())
    tls = RunTLS(secret)
    connect = spread_port_connections if a.spread else open_connections
    nbytes = a.mib * 2**20
    gen = torch.Generator().manual_seed(int.from_bytes(secret[:8], "big") >> 1)   # the same bytes on both sides
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    payload = memoryview(x.numpy())
    results = []
    for rep in range(a.reps):
        for k in (1, 4):
            for arm, _auth, _tls in ARMS:
                key = f"sec/{rep}/{k}/{arm}"
                use_tls = tls if arm.endswith("tls") else None
                if arm in ("tcp", "tls"):
                    if send:
                        results.append({"arm": arm, "k": k, "seconds": _raw_send(store, key, a.peer_host, k, payload,
                                                                                 use_tls, connect)})
                    else:
                        _raw_recv(store, key, a.host, k, use_tls)
                    continue
                me = 0 if send else 1
                tr = StripedTransport(me, store, secret=secret, host=a.host, connections=k, prefix=key,
                                      min_chunk_bytes=1 << 16, connect=connect, tls=use_tls is not None)
                if send:
                    tr.send(torch.zeros(1), 1, 0).wait()           # connections up and authenticated
                    t = time.perf_counter()
                    tr.send(x, 1, 1).wait()                        # until the receiver acked every byte
                    results.append({"arm": arm, "k": k, "seconds": time.perf_counter() - t})
                    store.get(f"{key}/received")
                else:
                    tr.recv(torch.empty(1), 0, 0).wait()
                    y = torch.empty(nbytes, dtype=torch.uint8)
                    tr.recv(y, 0, 1).wait()
                    assert torch.equal(x, y), f"{arm}: the transfer arrived altered"
                    store.set(f"{key}/received", "1")
                tr.close()
    if send:
        print(json.dumps(results))
    return 0


def _security_pair(start, store_host: str, host: tuple[str, str], mib: int, reps: int, spread: bool) -> list[dict]:
    """Runs the receiving and the sending role (start(side, argv) -> Popen) and returns the timings."""
    common = [PY, os.path.abspath(__file__), "--store-host", store_host, "--mib", str(mib), "--reps", str(reps)]
    if spread:
        common.append("--spread")
    port = ["--store-port", str(_free_port() if store_host.startswith("127.") else 29656)]
    recv = start("recv", [*common, *port, "--security-role", "recv", "--host", host[1], "--peer-host", host[0]])
    send = start("send", [*common, *port, "--security-role", "send", "--host", host[0], "--peer-host", host[1]])
    out, _ = send.communicate(timeout=900)
    recv.communicate(timeout=60)
    if send.returncode != 0 or recv.returncode != 0:
        raise SystemExit(f"bench_wan --security: a role failed (send rc {send.returncode}, recv rc {recv.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def security(a: argparse.Namespace) -> int:
    import statistics

    columns = {}
    pipe = {"stdout": subprocess.PIPE, "text": True}
    columns["loopback"] = (a.mib, _security_pair(lambda _side, argv: subprocess.Popen(argv, **pipe), "127.0.0.1",
                                                  ("127.0.0.1", "127.0.0.1"), a.mib, a.reps, spread=False))
    cluster, why = _bench_cluster(a), ""
    from geotrain.emulation import WanEmulation, emulation_available

    ok, why = emulation_available()
    if ok:
        with WanEmulation(cluster) as wan:
            east, west = wan.address("east"), wan.address("west")
            dcs = {"send": "east", "recv": "west"}
            columns["emulated WAN"] = (a.wan_mib, _security_pair(lambda side, argv: wan.popen(dcs[side], argv, **pipe),
                                                                 east, (east, west), a.wan_mib, a.reps, spread=True))
    link = cluster.wan_links[0]
    print(f"transport throughput, authentication and TLS on/off, median of {a.reps} interleaved rounds; Gbit/s and "
          f"ratio to plain TCP ({os.cpu_count()} CPUs, shared machine: noisy)")
    print("  loopback: " + f"{a.mib} MiB per transfer (the CPU cost that would cap a fast link)")
    if ok:
        print(f"  emulated WAN: {a.wan_mib} MiB per transfer, {link.latency_ms:g} ms one-way, {link.capacity_gbps:g} "
              f"Gbit/s, {link.per_connection_gbps:g} Gbit/s per connection (kernel emulation)")
    else:
        print(f"  emulated WAN: not measured ({why})")
    heads = [f"{col} {k} conn" for col in columns for k in (1, 4)]
    print(f"{'arm':>11} {'auth':>4} {'TLS':>4} | " + " | ".join(f"{h:>22}" for h in heads))
    for arm, auth, tls in ARMS:
        cells = []
        for _col, (mib, res) in columns.items():
            for k in (1, 4):
                med = statistics.median(r["seconds"] for r in res if r["arm"] == arm and r["k"] == k)
                base = statistics.median(r["seconds"] for r in res if r["arm"] == "tcp" and r["k"] == k)
                cells.append(f"{mib * 2**20 * 8 / med / 1e9:>13.3f} {base / med:>6.2f}x")
        print(f"{arm:>11} {auth:>4} {tls:>4} | " + " | ".join(f"{c:>22}" for c in cells))
    return 0


def _bench_cluster(a: argparse.Namespace):
    from geotrain.spec import Cluster

    per_conn = a.per_connection_gbps or a.capacity_gbps / 4
    return Cluster.model_validate({
        "name": "bench-wan",
        "datacenters": [{"name": "east", "gpu_type": "cpu", "gpus": 1}, {"name": "west", "gpu_type": "cpu", "gpus": 1}],
        "wan_links": [{"between": ["east", "west"], "latency_ms": a.latency_ms, "capacity_gbps": a.capacity_gbps,
                       "per_connection_gbps": per_conn}],
    })


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--security", action="store_true",
                    help="measure authentication and TLS on/off instead: over loopback, and over the emulated WAN "
                         "when root")
    ap.add_argument("--wan-mib", type=int, default=16, help="--security: transfer size over the emulated WAN")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--capacity-gbps", type=float, default=0.4)
    ap.add_argument("--per-connection-gbps", type=float, default=None, help="default: capacity / 4")
    ap.add_argument("--mib", type=int, default=16, help="tensor size for the striped transfer")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=2.0, help="raw TCP measurement window")
    ap.add_argument("--role", choices=["send", "recv"], help=argparse.SUPPRESS)
    ap.add_argument("--store-host", help=argparse.SUPPRESS)
    ap.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--security-role", choices=["send", "recv"], help=argparse.SUPPRESS)
    ap.add_argument("--peer-host", help=argparse.SUPPRESS)
    ap.add_argument("--spread", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.security_role:
        from geotrain.process import exit_skipping_teardown

        exit_skipping_teardown(_security_role(a))
    if a.security:
        if a.mib == 16:
            a.mib = 64
        a.reps = max(a.reps, 3)
        return security(a)
    if a.role:
        from geotrain.process import exit_skipping_teardown

        exit_skipping_teardown(_peer(a))    # a TCPStore's C++ threads can abort a normal exit

    from geotrain.emulation import WanEmulation, emulation_available

    ok, why = emulation_available()
    if not ok:
        print(f"bench_wan: needs the kernel WAN emulation ({why}); run as root", file=sys.stderr)
        return 2
    per_conn = a.per_connection_gbps or a.capacity_gbps / 4
    cluster = _bench_cluster(a)
    link = cluster.wan_links[0]
    with WanEmulation(cluster) as wan:
        east, west = wan.address("east"), wan.address("west")
        import tempfile

        from geotrain.emulation.probe import probe_env

        env = probe_env(Path(tempfile.mkdtemp(prefix="geotrain-bench-")))
        srv = wan.popen("west", [PY, "-m", "geotrain.emulation.probe", "serve", "--host", west], stdout=subprocess.PIPE,
                        text=True, env=env)
        port = srv.stdout.readline().split()[1]
        rtt = json.loads(wan.exec_in("east", [PY, "-m", "geotrain.emulation.probe", "ping", "--host", west,
                                              "--port", port], env=env).stdout)["rtt_ms"]
        raw = {}
        for k in COUNTS:
            r = wan.exec_in("east", [PY, "-m", "geotrain.emulation.probe", "send", "--host", west, "--port", port,
                                     "--connections", str(k), "--seconds", str(a.seconds)], env=env)
            raw[k] = json.loads(r.stdout)["gbps"]
        shutil.rmtree(Path(env["GEOTRAIN_SECRET_FILE"]).parent, ignore_errors=True)
        common = [PY, os.path.abspath(__file__), "--store-host", east, "--store-port", "29655",
                  "--mib", str(a.mib), "--reps", str(a.reps)]
        recv = wan.popen("west", [*common, "--role", "recv", "--host", west], stdout=subprocess.PIPE, text=True)
        send = wan.popen("east", [*common, "--role", "send", "--host", east], stdout=subprocess.PIPE, text=True)
        out, _ = send.communicate(timeout=600)
        recv.communicate(timeout=60)
        if send.returncode != 0:
            print("bench_wan: striped transfer failed", file=sys.stderr)
            return 1
        striped = json.loads(out.strip().splitlines()[-1])

    nbytes = a.mib * 2**20
    print(f"emulated WAN: {a.latency_ms:g} ms one-way (measured RTT {rtt:.1f} ms), capacity {a.capacity_gbps:g} "
          f"Gbit/s, {per_conn:g} Gbit/s per connection; striped tensor {a.mib} MiB, best of {a.reps}")
    print(f"{'conns':>5} | {'TCP Gbit/s':>10} {'predicted':>9} {'ratio':>5} | {'striped s':>9} {'predicted':>9} "
          f"{'ratio':>5} {'Gbit/s':>7} | {'speed-up vs 1 (meas / pred)':>27}")
    base_meas = base_pred = None
    for k in COUNTS:
        pred_rate = link.rate_gbps(k)
        pred_s = a.latency_ms / 1e3 + nbytes * 8 / (pred_rate * 1e9)
        meas_s = min(r["seconds"] for r in striped if r["k"] == k) - a.latency_ms / 1e3     # minus the ack
        base_meas, base_pred = base_meas or meas_s, base_pred or pred_s
        print(f"{k:>5} | {raw[k]:>10.3f} {pred_rate:>9.3f} {raw[k] / pred_rate:>5.2f} | {meas_s:>9.3f} "
              f"{pred_s:>9.3f} {meas_s / pred_s:>5.2f} {nbytes * 8 / meas_s / 1e9:>7.3f} | "
              f"{base_meas / meas_s:>12.2f} / {base_pred / pred_s:<12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
