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

    .venv/bin/python bench/bench_wan.py --security [--mib 64] [--reps 3]      # no root needed

The price of securing the transport, over loopback (no emulated WAN: a real WAN is slower than
any of these, so what is measured is the CPU cost that would cap a fast link), 1 and 4
connections side by side, sender and receiver as threads of one process:
  * raw TCP striped over k sockets (authentication off, TLS off) -- the baseline;
  * raw TCP + HMAC-SHA256 per 1 MiB block on both ends (authentication on, TLS off);
  * TLS (stdlib ssl, TLS 1.3, a throwaway self-signed ECDSA certificate) (authentication off, TLS on);
  * TLS + HMAC (both on);
  * StripedTransport itself (authenticated frames, acknowledgements, resend bookkeeping; no TLS:
    the transport does not offer TLS yet), send until the receiver has every byte.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

COUNTS = (1, 2, 4, 8)
PY = sys.executable


def _peer(a: argparse.Namespace) -> int:
    """Runs inside a DC namespace: rank 0 (east) sends, rank 1 (west) receives and acks."""
    import torch
    import torch.distributed as dist

    from geotrain.emulation.ports import spread_port_connections
    from geotrain.wan.striped import StripedTransport

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


def _tls_contexts(tmp: str):
    import ssl

    key, cert = os.path.join(tmp, "k.pem"), os.path.join(tmp, "c.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=geotrain-bench", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(cert)
    client.check_hostname = False
    return server, client


def _raw_stripes(k: int, nbytes: int, tls=None, mac: bool = False) -> float:
    """Seconds to move nbytes striped over k loopback connections (optionally TLS, HMAC per block)."""
    import hashlib
    import hmac
    import socket
    import threading

    key = os.urandom(32)
    block = 1 << 20
    payload = memoryview(os.urandom(nbytes))
    ls = socket.create_server(("127.0.0.1", 0))
    port = ls.getsockname()[1]
    parts = [(nbytes * i // k, nbytes * (i + 1) // k) for i in range(k)]
    sink = bytearray(nbytes)

    def serve(i: int, conn) -> None:
        if tls is not None:
            conn = tls[0].wrap_socket(conn, server_side=True)
        view = memoryview(sink)[parts[i][0]:parts[i][1]]
        got = 0
        h = hmac.new(key, digestmod=hashlib.sha256) if mac else None
        while got < len(view):
            n = conn.recv_into(view[got:], min(block, len(view) - got))
            if n == 0:
                break
            if h is not None:
                h.update(view[got:got + n])
            got += n
        conn.sendall(b"k")
        conn.close()

    def accept() -> None:
        for i in range(k):
            c, _ = ls.accept()
            threading.Thread(target=serve, args=(i, c), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    socks = []
    for _ in range(k):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(tls[1].wrap_socket(s, server_hostname="geotrain-bench") if tls is not None else s)
        time.sleep(0.01)            # connections accepted in order: stripe i goes to serve(i)

    def send(i: int) -> None:
        a, b = parts[i]
        h = hmac.new(key, digestmod=hashlib.sha256) if mac else None
        for off in range(a, b, block):
            piece = payload[off:min(b, off + block)]
            if h is not None:
                h.update(piece)
            socks[i].sendall(piece)
        socks[i].recv(1)

    t = time.perf_counter()
    th = [threading.Thread(target=send, args=(i,)) for i in range(k)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    dt = time.perf_counter() - t
    for s in socks:
        s.close()
    ls.close()
    return dt


def _striped(k: int, nbytes: int) -> float:
    import torch
    import torch.distributed as dist

    from geotrain.wan.striped import StripedTransport

    store = dist.HashStore()
    a = StripedTransport(0, store, connections=k, min_chunk_bytes=1 << 16)
    b = StripedTransport(1, store, connections=k)
    try:
        b.recv(torch.empty(1), 0, 0)
        a.send(torch.zeros(1), 1, 0).wait()          # connections up and authenticated
        x, y = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
        t = time.perf_counter()
        w = b.recv(y, 0, 1)
        a.send(x, 1, 1).wait()
        w.wait()
        dt = time.perf_counter() - t
        assert torch.equal(x, y)
        return dt
    finally:
        a.close()
        b.close()


def security(a: argparse.Namespace) -> int:
    import statistics
    import tempfile

    nbytes = a.mib * 2**20
    with tempfile.TemporaryDirectory() as tmp:
        tls = _tls_contexts(tmp)
        arms = {"tcp": lambda k: _raw_stripes(k, nbytes),
                "tcp+hmac": lambda k: _raw_stripes(k, nbytes, mac=True),
                "tls": lambda k: _raw_stripes(k, nbytes, tls=tls),
                "tls+hmac": lambda k: _raw_stripes(k, nbytes, tls=tls, mac=True),
                "striped": lambda k: _striped(k, nbytes)}
        times: dict[tuple[str, int], list[float]] = {}
        for _rep in range(a.reps):                  # arms interleaved per repetition: load drifts hit all
            for k in (1, 4):
                for name, arm in arms.items():
                    times.setdefault((name, k), []).append(arm(k))
    print(f"loopback, {a.mib} MiB per transfer, median of {a.reps} (one process, sender and receiver threads; "
          f"{os.cpu_count()} CPUs, shared machine: noisy)")
    print(f"{'arm':>9} {'auth':>4} {'TLS':>4} | " + " | ".join(f"{k} conn Gbit/s  vs tcp" for k in (1, 4)))
    flags = {"tcp": ("off", "off"), "tcp+hmac": ("on", "off"), "tls": ("off", "on"), "tls+hmac": ("on", "on"),
             "striped": ("on", "off")}
    for name in arms:
        cells = []
        for k in (1, 4):
            med, base = statistics.median(times[(name, k)]), statistics.median(times[("tcp", k)])
            cells.append(f"{nbytes * 8 / med / 1e9:>13.2f} {base / med:>6.2f}x")
        print(f"{name:>9} {flags[name][0]:>4} {flags[name][1]:>4} | " + " | ".join(cells))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--security", action="store_true",
                    help="measure authentication and TLS costs over loopback instead (no root)")
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
    a = ap.parse_args()
    if a.security:
        if a.mib == 16:
            a.mib = 64
        a.reps = max(a.reps, 3)
        return security(a)
    if a.role:
        from geotrain.process import exit_skipping_teardown

        exit_skipping_teardown(_peer(a))    # a TCPStore's C++ threads can abort a normal exit

    from geotrain.config import Cluster
    from geotrain.emulation import WanEmulation, emulation_available

    ok, why = emulation_available()
    if not ok:
        print(f"bench_wan: needs the kernel WAN emulation ({why}); run as root", file=sys.stderr)
        return 2
    per_conn = a.per_connection_gbps or a.capacity_gbps / 4
    cluster = Cluster.model_validate({
        "name": "bench-wan",
        "datacenters": [{"name": "east", "gpu_type": "cpu", "gpus": 1}, {"name": "west", "gpu_type": "cpu", "gpus": 1}],
        "wan_links": [{"between": ["east", "west"], "latency_ms": a.latency_ms, "capacity_gbps": a.capacity_gbps,
                       "per_connection_gbps": per_conn}],
    })
    link = cluster.wan_links[0]
    with WanEmulation(cluster) as wan:
        east, west = wan.address("east"), wan.address("west")
        srv = wan.popen("west", [PY, "-m", "geotrain.emulation.probe", "serve", "--host", west], stdout=subprocess.PIPE,
                        text=True)
        port = srv.stdout.readline().split()[1]
        rtt = json.loads(wan.exec_in("east", [PY, "-m", "geotrain.emulation.probe", "ping", "--host", west,
                                              "--port", port]).stdout)["rtt_ms"]
        raw = {}
        for k in COUNTS:
            r = wan.exec_in("east", [PY, "-m", "geotrain.emulation.probe", "send", "--host", west, "--port", port,
                                     "--connections", str(k), "--seconds", str(a.seconds)])
            raw[k] = json.loads(r.stdout)["gbps"]
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
