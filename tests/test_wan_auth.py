"""Attacks on the WAN listeners, in-process over loopback: forged, garbage, oversize, tampered,
replayed and reset connections are refused (one line each) and the transfers still arrive exactly.

A man-in-the-middle relay is put between two transports by pointing the sender's store entry for
the receiver at the relay; it forwards bytes and, as told, flips one bit, resets the connection
mid-stream, or records the stream for a later replay."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _drip import drip_until_closed

from geotrain.errors import GeotrainError
from geotrain.transport.auth import STRIPED, AuthError, client_handshake, read_secret_file, write_secret_file
from geotrain.transport.striped import FRAME, StripedTransport, TransportError
from geotrain.transport.striped_frames import DATA
from geotrain.transport.turns import RemoteTurns, TurnArbiter

OLD_HELLO = struct.Struct("!IiH")            # the pre-authentication hello: magic, rank, stripe
OLD_MAGIC = 0x47545350
OLD_HEADER = struct.Struct("!IqQHHQQQI")


class Relay:
    """Forwards connections to `target`; `flip_at`: flip one bit of client->server byte N (once);
    `reset_after`: abort the first connection after N client->server bytes; records what it saw."""

    def __init__(self, target: tuple[str, int], flip_at: int | None = None, reset_after: int | None = None):
        self.target, self.flip_at, self.reset_after = target, flip_at, reset_after
        self.recorded: list[bytes] = []
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.port = self.ls.getsockname()[1]
        self.conns = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            s = socket.create_connection(self.target)
            first = self.conns == 0
            self.conns += 1
            log: list[bytes] = []
            self.recorded.append(log)
            threading.Thread(target=self._pump, args=(c, s, first, log), daemon=True).start()
            threading.Thread(target=self._pump, args=(s, c, False, None), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, first: bool, log) -> None:
        seen = 0
        try:
            while True:
                data = bytearray(a.recv(1 << 16))
                if not data:
                    break
                if first and self.flip_at is not None and seen <= self.flip_at < seen + len(data):
                    data[self.flip_at - seen] ^= 0x10
                if first and self.reset_after is not None and seen + len(data) > self.reset_after:
                    b.sendall(data[:self.reset_after - seen])
                    for x in (a, b):          # an abortive close (RST), as `ss -K` or a middlebox does
                        x.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        x.close()
                    return
                if log is not None:
                    log.append(bytes(data))
                seen += len(data)
                b.sendall(data)
        except OSError:
            pass
        for x in (a, b):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.ls.close()


def _pair(store, **kw):
    a = StripedTransport(0, store, connections=2, min_chunk_bytes=1024, timeout_s=30, **kw)
    b = StripedTransport(1, store, connections=2, min_chunk_bytes=1024, timeout_s=30, **kw)
    return a, b


def _through_relay(store, b: StripedTransport, **kw) -> Relay:
    relay = Relay(("127.0.0.1", b.port), **kw)
    store.set("geotrain/striped/1", f"127.0.0.1:{relay.port}")
    return relay


def _transfer(a, b, tag: int, n: int = 300_000) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(tag))
    y = torch.empty_like(x)
    w = b.recv(y, 0, tag)
    a.send(x, 1, tag).wait()
    w.wait(timeout=30)
    assert torch.equal(x, y)


def _wait_for(cond, timeout=10.0) -> None:
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < timeout
        time.sleep(0.02)


def _attack(port: int, payload: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(payload)
        s.settimeout(0.3)
        try:
            s.recv(100)
        except OSError:
            pass


def test_forged_garbage_and_wrong_secret_connections_are_dropped_and_transfers_go_on(capfd):
    store = dist.HashStore()
    a, b = _pair(store)
    try:
        _transfer(a, b, 1)
        attacks = [OLD_HELLO.pack(OLD_MAGIC, 0, 0),                                        # forged hello, rank 0
                   os.urandom(4096),                                                       # garbage
                   OLD_HELLO.pack(OLD_MAGIC, 0, 0) + OLD_HEADER.pack(OLD_MAGIC, 1, 0, 0, 1, 2**62, 0, 2**62, 0)]
        for p in attacks:
            _attack(b.port, p)
        intruder = StripedTransport(0, dist.HashStore(), secret=b"x" * 32, connections=1, timeout_s=0.5)  # rank 0?
        intruder.store.set("geotrain/striped/1", f"127.0.0.1:{b.port}")
        with pytest.raises(TransportError):
            intruder.send(torch.ones(10), 1, 1).wait(timeout=3)
        intruder.close()
        _wait_for(lambda: b.drops.dropped >= 4)
        _transfer(a, b, 2)                             # the real rank 0 is unaffected
    finally:
        a.close()
        b.close()
    err = capfd.readouterr().err
    assert err.count("rank 1 striped listener: dropped a connection") >= 4
    assert "Traceback" not in err


def test_an_oversize_header_from_an_authenticated_peer_is_refused_without_allocating():
    store = dist.HashStore()
    a, b = _pair(store)
    try:
        secret = b.secret
        s = socket.create_connection(("127.0.0.1", b.port))
        ch = client_handshake(s, secret, STRIPED, 0, 1)
        ch.send(FRAME.pack(DATA, 0, 7, 0, 2**62, 0, 2**31, 0))       # a 2 GiB frame: refused from the header
        _wait_for(lambda: b.drops.dropped >= 1)
        assert "payload bytes" in b.drops.lines[-1]
        s = socket.create_connection(("127.0.0.1", b.port))
        ch = client_handshake(s, secret, STRIPED, 0, 1)
        ch.send(FRAME.pack(DATA, 0, 7, 0, 2**62, 0, 16, 0), b"\0" * 16)   # a 4 EiB message: no buffer for it
        _wait_for(lambda: b._slots)                          # (a recv posted first would see a size mismatch)
        with pytest.raises(TransportError, match="more than the largest"):
            b.recv(torch.empty(4), 0, 7).wait(timeout=10)
        s.close()
    finally:
        a.close()
        b.close()


def test_a_bit_flipped_frame_is_refused_and_the_message_resent():
    store = dist.HashStore()
    a, b = _pair(store)
    relay = _through_relay(store, b, flip_at=20_000)        # well past the handshake: inside tensor bytes
    try:
        _transfer(a, b, 3, n=500_000)
        assert any("failed authentication" in line for line in b.drops.lines), b.drops.lines
        assert relay.conns > 2                               # the sender reconnected
        _transfer(a, b, 4)
    finally:
        a.close()
        b.close()
        relay.close()


def test_a_connection_reset_mid_transfer_is_reestablished_and_the_message_resent():
    store = dist.HashStore()
    a, b = _pair(store)
    relay = _through_relay(store, b, reset_after=200_000)
    try:
        _transfer(a, b, 5, n=1_000_000)
        assert relay.conns > 2
        _transfer(a, b, 6)
    finally:
        a.close()
        b.close()
        relay.close()


def test_a_replayed_connection_is_refused():
    store = dist.HashStore()
    a, b = _pair(store)
    relay = _through_relay(store, b)
    try:
        _transfer(a, b, 8)
        recorded = b"".join(relay.recorded[0])
        assert len(recorded) > 100_000
        _attack(b.port, recorded)                            # the whole first connection, byte for byte
        _wait_for(lambda: b.drops.dropped >= 1)
        assert "failed the challenge" in b.drops.lines[-1]
        late = b.recv(torch.empty(300_000), 0, 8)
        time.sleep(0.5)
        assert not late.is_completed()                       # nothing was delivered twice
        _transfer(a, b, 9)
    finally:
        a.close()
        b.close()
        relay.close()


def test_the_turn_arbiter_drops_forged_connections_and_keeps_serving():
    secret = os.urandom(32)
    arb = TurnArbiter([0, 1], timeout_s=5)
    host, port = arb.serve(secret=secret)
    try:
        for p in (struct.pack("!Iq", 0x47545455, 0) + b"A", os.urandom(512)):
            _attack(port, p)
        with pytest.raises(AuthError):
            RemoteTurns(host, port, 0, secret=b"y" * 32).acquire()
        _wait_for(lambda: arb.drops.dropped >= 3)
        assert arb.holder is None and arb.grants == []
        good = [RemoteTurns(host, port, k, secret=secret) for k in (0, 1)]
        for k in (0, 1):
            good[k].acquire()
            good[k].release()
        assert arb.grants == [0, 1]
        for g in good:
            g.close()
    finally:
        arb.close()


def test_the_secret_file_is_private(tmp_path):
    path = write_secret_file(tmp_path / "s", os.urandom(32))
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert len(read_secret_file(path)) == 32
    os.chmod(path, 0o644)
    with pytest.raises(GeotrainError, match="owner only"):
        read_secret_file(path)


def test_tls_transfers_arrive_exactly_and_a_listener_refuses_plain_or_foreign_tls(capfd):
    store = dist.HashStore()
    a, b = _pair(store, tls=True)
    try:
        _transfer(a, b, 11, n=700_000)                       # several frames over both connections
        _transfer(a, b, 12)
        _attack(b.port, OLD_HELLO.pack(OLD_MAGIC, 0, 0))     # plain TCP to a TLS listener
        foreign = StripedTransport(0, dist.HashStore(), secret=b"z" * 32, connections=1, tls=True, timeout_s=0.5)
        foreign.store.set("geotrain/striped/1", f"127.0.0.1:{b.port}")
        with pytest.raises(TransportError):
            foreign.send(torch.ones(10), 1, 1).wait(timeout=3)   # another run's certificate: refused
        foreign.close()
        _wait_for(lambda: b.drops.dropped >= 2)
        _transfer(a, b, 13)
    finally:
        a.close()
        b.close()
    err = capfd.readouterr().err
    assert "TLS handshake failed ([SSL: WRONG_VERSION_NUMBER]" in err, err    # the plain-TCP client
    assert "TLS certificate is not this run's" in err, err                     # the foreign run's listener check
    assert "Traceback" not in err


def test_the_wan_probe_serves_only_openers_with_its_secret(tmp_path):
    """...and an opener dripping its hello is dropped at the handshake deadline (6 x 0.25 s here):
    the probe's per-read timeout was restarted by every byte."""
    import subprocess
    import sys

    from geotrain.emulation.probe import SINK_HDR, probe_env

    env = {**os.environ, **probe_env(tmp_path), "GEOTRAIN_HANDSHAKE_TIMEOUT_S": "0.25"}
    probe = [sys.executable, "-m", "geotrain.emulation.probe"]
    srv = subprocess.Popen([*probe, "serve", "--host", "127.0.0.1"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        port = int(srv.stdout.readline().split()[1])
        with socket.create_connection(("127.0.0.1", port)) as drip:
            took = drip_until_closed(drip)
            assert took < 3, took
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:   # the old protocol: ping, no proof
            s.sendall(SINK_HDR.pack(b"P", 0.0) + b"x" * 64)
            echo = b""
            try:
                while data := s.recv(1 << 16):
                    echo += data
            except ConnectionResetError:
                pass
        assert b"x" * 64 not in echo                                          # not echoed: dropped
        r = subprocess.run([*probe, "ping", "--host", "127.0.0.1", "--port", str(port), "--count", "3"], env=env,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and json.loads(r.stdout)["rtt_ms"] > 0, r.stderr
        bare = {k: v for k, v in env.items() if k != "GEOTRAIN_SECRET_FILE"}
        r = subprocess.run([*probe, "ping", "--host", "127.0.0.1", "--port", str(port)], env=bare,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "GEOTRAIN_SECRET_FILE" in r.stderr, r.stderr
    finally:
        srv.kill()
    err = srv.communicate()[1]
    assert err.count("geotrain emulation: probe: dropped a connection from 127.0.0.1:") == 2, err
    assert "not finished within 1.5 s" in err and "Traceback" not in err, err


def test_a_secret_shared_through_the_store_is_warned_about_once(monkeypatch, capfd):
    from geotrain.transport import auth

    monkeypatch.delenv("GEOTRAIN_SECRET_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(auth, "_warned", [])
    store = dist.HashStore()
    first, again = auth.run_secret(store), auth.run_secret(store)
    assert first == again and len(first) == 32
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(lines) == 1 and "anyone who can reach MASTER_ADDR:MASTER_PORT can read it" in lines[0], err
    monkeypatch.setattr(auth, "_warned", [])
    monkeypatch.setenv("RANK", "3")                            # the other ranks stay quiet
    auth.run_secret(store)
    assert "warning" not in capfd.readouterr().err


def test_hosts_with_different_secret_files_fail_the_send_in_seconds_saying_so(capfd):
    """The listener drops a connection whose proof fails; the sender used to take that for a blip and
    retry until its outage limit (300 s). Now three refusals in a row end the transfer with the reason."""
    store = dist.HashStore()
    b = StripedTransport(1, store, secret=b"b" * 32, connections=2, timeout_s=120)
    a = StripedTransport(0, store, secret=b"a" * 32, connections=2, timeout_s=120)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="another secret"):
            a.send(torch.ones(1000), 1, 1).wait(timeout=60)
        assert time.monotonic() - t0 < 10
    finally:
        a.close()
        b.close()
    assert "Traceback" not in capfd.readouterr().err
