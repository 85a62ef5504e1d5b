"""StripedTransport: one tensor over K authenticated TCP connections, resent if a connection breaks.

On a WAN one TCP connection is window/RTT bound, so a cross-DC transfer is split into K chunks
sent on K connections at once (Atlas). It implements the runtime's Transport contract (`send`,
`recv`: non-blocking; messages of one (src, dst, tag) matched in order sent).
Trust: `transport.auth`'s handshake, then only HMAC-authenticated frames (`striped_frames`),
optionally inside TLS 1.3 (`tls`); anything forged, altered, replayed or oversized is logged and its
connection dropped, and the run goes on. Nothing received is unpickled; a payload is copied only
after its tag verified; an early message's buffer is bounded by `max_message_bytes`.
Delivery: messages are numbered and acknowledged; the sender (`striped_send`) keeps each until its
ACK, so after a reset it reconnects and resends and the receiver drops duplicates. A stall is
reported every `stall_s`; a link down for `timeout_s` ends the run, named. A BYE fails pending
receives at once. Rendezvous: each rank listens on `host`:ephemeral and publishes "host:port" in
a Store; connections open on the first send, on consecutive even source ports (`sockets`).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from geotrain.transport.admission import Gate, accept_loop
from geotrain.transport.auth import (
    HANDSHAKE_TIMEOUT_S,
    STRIPED,
    AuthError,
    Channel,
    DropLog,
    ProtocolError,
    run_secret,
    server_handshake,
)
from geotrain.transport.sockets import close_quietly, open_connections, tune
from geotrain.transport.striped_frames import (
    ACK,
    BYE,
    DATA,
    DEFAULT_MAX_MESSAGE_BYTES,
    FRAME,
    FRAME_BYTES,
    DueTimers,
    IdSet,
    TransportError,
    Work,
    byte_view,
    frame_payload,
    store_get,
)
from geotrain.transport.striped_send import Outgoing, Peer
from geotrain.transport.tls import RunTLS

__all__ = ["FRAME", "StripedTransport", "TransportError", "Work"]


@dataclass
class _Slot:
    """One incoming message (src, tag, seq): where its bytes go, and which frames already arrived."""

    total: int
    view: memoryview | None = None          # the posted tensor's bytes (when contiguous)
    buffer: bytearray | None = None         # bytes that arrived before the recv was posted
    target: torch.Tensor | None = None      # posted tensor
    staging: torch.Tensor | None = None     # contiguous staging for a non-contiguous target
    work: Work | None = None
    msg: int | None = None                  # the sender's message id
    got: set[int] = field(default_factory=set)   # offsets of the frames already copied
    have: int = 0
    arrived: bool = False                   # every byte is here
    ready: bool = False                     # ... and its (shaper) delay has passed
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class StripedTransport:
    """Multi-connection authenticated point-to-point transport (see module docstring).

    secret: the run's secret; every peer must hold the same (default: `transport.auth.run_secret(store)`).
    connections: K per destination (int, or a function of the destination rank).
    shaper: a pacing hook per destination (or a function of the destination returning one or None):
        an object with `active`, `delay_ms` and `pacing()`, whose `connection()` gives each connection
        a `wait_for(nbytes)` -- the emulation's user-space shaper (geotrain.emulation.user_shaper) plugs in
        here; None (a real WAN, or the kernel emulation) sends at the wire's pace.
    connect: opens the K connections to a peer (default `sockets.open_connections`, plain sockets);
        the kernel emulation passes its source-port-spreading variant.
    turns: temporal link sharing, a function dst -> object with acquire()/release(), or None.
    describe: rank -> how to name it in messages (e.g. "rank 2 (west)").
    tls: wrap every connection in TLS keyed by the secret (`transport.tls`): encrypted, not just authenticated.
    """

    def __init__(self, rank: int, store, *, secret: bytes | None = None, host: str = "127.0.0.1",
                 connections: int | Callable[[int], int] = 4,
                 shaper: object | Callable[[int], object | None] | None = None,
                 turns: Callable[[int], object | None] | None = None,
                 prefix: str = "geotrain/striped", min_chunk_bytes: int = 64 << 10, timeout_s: float = 600.0,
                 stall_s: float = 30.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 describe: Callable[[int], str] | None = None,
                 connect: Callable[..., list[socket.socket]] = open_connections, tls: bool = False):
        secret = secret or run_secret(store)
        self.tls = RunTLS(secret) if tls else None
        self.rank, self.store, self.secret, self.host, self.prefix = rank, store, secret, host, prefix
        self.min_chunk_bytes = min_chunk_bytes
        self.timeout_s, self.stall_s = timeout_s, stall_s
        self.max_message_bytes = max_message_bytes
        self._describe = describe
        self._connections, self._shaper, self._turns = connections, shaper, turns
        self.open_connections = connect
        self._lock = threading.Lock()
        self._peers: dict[int, Peer] = {}
        self._send_seq: dict[tuple[int, int], int] = {}
        self._recv_seq: dict[tuple[int, int], int] = {}
        self._slots: dict[tuple[int, int, int], _Slot] = {}
        self._arrived: dict[int, IdSet] = {}           # per sender: message ids complete here
        self._lost: dict[int, BaseException] = {}      # senders that closed their transport
        self._timers = DueTimers("striped-delay")      # shaper-delayed completions (the fallback's latency)
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._addresses: dict[int, tuple[str, int]] = {}
        self.drops = DropLog(f"rank {rank} striped listener")
        self.gate = Gate(trusted=lambda: {h for h, _ in list(self._addresses.values())})   # transport.admission
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        store.set(f"{prefix}/{rank}", f"{host}:{self.port}")
        threading.Thread(target=self._accept, name="striped-accept", daemon=True).start()

    # ------------------------------------------------------------------ configuration lookups
    def connections_for(self, dst: int) -> int:
        k = self._connections(dst) if callable(self._connections) else self._connections
        return max(1, int(k))

    def shaper_for(self, dst: int):
        return self._shaper(dst) if callable(self._shaper) else self._shaper

    def turns_for(self, dst: int):
        return self._turns(dst) if self._turns is not None else None

    def describe(self, rank: int) -> str:
        return self._describe(rank) if self._describe is not None else f"rank {rank}"

    def say(self, line: str) -> None:
        print(f"geotrain wan: rank {self.rank}: {line}\n", end="", file=sys.stderr, flush=True)   # one write

    def lookup(self, rank: int) -> tuple[str, int]:
        """`rank`'s address, from the store once: a reconnect must not need it (a reset may take it too)."""
        if rank not in self._addresses:
            raw = store_get(self.store, f"{self.prefix}/{rank}", self.timeout_s,
                            f"listening address of {self.describe(rank)}")
            self._addresses[rank] = (raw.rpartition(":")[0], int(raw.rpartition(":")[2]))
        return self._addresses[rank]

    # ------------------------------------------------------------------ Transport API
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        if dst == self.rank:
            raise ValueError("a transport sends only to other ranks")
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes > self.max_message_bytes:
            raise TransportError(f"send to {self.describe(dst)}: {nbytes} bytes exceed the largest message "
                                 f"this run sends ({self.max_message_bytes})")
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            seq = self._send_seq.get((dst, tag), 0)
            self._send_seq[(dst, tag)] = seq + 1
            peer = self._peers.get(dst)
            if peer is None:
                peer = self._peers[dst] = Peer(self, dst)
            msg, peer.next_msg = peer.next_msg, peer.next_msg + 1
        work = Work(f"send to {self.describe(dst)} (tag {tag}, {nbytes} bytes)", self.timeout_s, self.stall_s,
                    self.say)
        peer.submit(Outgoing(msg, tag, seq, byte_view(t), work, keep=t))
        return work

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        nbytes = tensor.numel() * tensor.element_size()
        work = Work(f"recv from {self.describe(src)} (tag {tag}, {nbytes} bytes)", self.timeout_s, self.stall_s,
                    self.say)
        direct = tensor.device.type == "cpu" and tensor.is_contiguous()
        staging = None if direct else torch.empty(tensor.shape, dtype=tensor.dtype)
        with self._lock:
            seq = self._recv_seq.get((src, tag), 0)
            self._recv_seq[(src, tag)] = seq + 1
            key = (src, tag, seq)
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot(total=nbytes)
                slot.error = self._lost.get(src)
            with slot.lock:
                slot.work, slot.target, slot.staging = work, tensor, staging
                if slot.total != nbytes:
                    slot.error = slot.error or ValueError(f"size mismatch: sender sent {slot.total} bytes, "
                                                          f"receiver expects {nbytes}")
                if slot.buffer is None and slot.error is None:
                    slot.view = byte_view(staging if staging is not None else tensor)
                finished = slot.ready or slot.error is not None
        if finished:
            self._complete(key, slot)
        return work

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
            conns = list(self._conns)
        for p in peers:
            p.close()
        try:
            self._listener.close()
        except OSError:
            pass
        close_quietly(*conns)
        self._timers.close()

    def __enter__(self) -> StripedTransport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ receiving side
    def _accept(self) -> None:
        accept_loop(self._listener, lambda: self._closed, self._admit, self.say)

    def _admit(self, conn: socket.socket, addr) -> None:
        self.gate.serve(conn, addr, self._serve, "striped-read", self.drops)

    def _serve(self, conn: socket.socket, addr, ticket) -> None:
        who = f"{addr[0]}:{addr[1]}"
        try:
            tune(conn)
            if self.tls is not None:
                conn = self.tls.wrap_server(conn, HANDSHAKE_TIMEOUT_S)
            src, _stripe, channel = server_handshake(conn, self.secret, STRIPED, self.rank)
        except (OSError, ConnectionError) as e:
            self.gate.done(ticket)
            conn.close()
            if not self._closed:
                self.drops(f"dropped a connection from {who}: {ticket.failure(e)}")
            return
        self.gate.done(ticket)
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        try:
            while True:
                fields, body = channel.recv(FRAME, frame_payload, FRAME_BYTES)
                if fields[0] == DATA:
                    self._on_data(src, fields, body, channel)
                elif fields[0] == BYE:
                    self._peer_closed(src)
                    return
                else:
                    raise ProtocolError(f"unexpected frame kind {fields[0]}")
        except (AuthError, ProtocolError) as e:
            if not self._closed:
                self.drops(f"dropped the connection of {self.describe(src)} from {who}: {e}")
        except (OSError, ConnectionError) as e:
            if not self._closed:
                self.say(f"connection from {self.describe(src)} lost ({e}); waiting for it to reconnect")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _on_data(self, src: int, fields: tuple, body: memoryview, channel: Channel) -> None:
        _kind, msg, tag, seq, total, offset, nbytes, delay_us = fields
        if offset + nbytes > total or (nbytes == 0 and total != 0):
            raise ProtocolError(f"frame [{offset}, +{nbytes}) outside its message of {total} bytes")
        with self._lock:
            arrived = self._arrived.setdefault(src, IdSet())
            slot = None
            if msg not in arrived:
                key = (src, tag, seq)
                slot = self._slots.get(key)
                if slot is None:
                    slot = self._slots[key] = _Slot(total=total)
                    if total > self.max_message_bytes:
                        slot.error = ValueError(f"{self.describe(src)} sent a message of {total} bytes, more than "
                                                f"the largest this run sends ({self.max_message_bytes})")
                    else:
                        slot.buffer = bytearray(total)
                        slot.view = memoryview(slot.buffer)
        if slot is None:                                  # a resend of a message we already have
            if offset == 0:
                channel.send(FRAME.pack(ACK, msg, 0, 0, 0, 0, 0, 0))
            return
        with slot.lock:
            if slot.msg is None:
                slot.msg = msg
            elif slot.msg != msg:
                raise ProtocolError(f"messages {slot.msg} and {msg} both claim tag {tag} #{seq}")
            if slot.total != total and slot.error is None:
                slot.error = ValueError(f"size mismatch: sender sent {total} bytes, receiver expects {slot.total}")
            failed = slot.error is not None and slot.work is not None   # a posted recv learns of it at once
            if not failed:
                if slot.arrived or offset in slot.got:
                    return
                if nbytes and slot.error is None and slot.view is not None:
                    slot.view[offset:offset + nbytes] = body
                slot.got.add(offset)
                slot.have += nbytes
                slot.arrived = slot.have >= total
            done = slot.arrived
        if failed:
            self._complete((src, tag, seq), slot)
            return
        if not done:
            return
        with self._lock:
            arrived.add(msg)
        try:
            # ACK before the recv completes: once it completes, the application may close this
            # transport and exit, and an ACK not yet written would leave the sender resending to
            # a peer that is gone. If the ACK cannot be written, the message completes anyway and
            # its resend is acked (`slot is None` above).
            channel.send(FRAME.pack(ACK, msg, 0, 0, 0, 0, 0, 0))
        finally:
            if delay_us:
                self._timers.at(time.monotonic() + delay_us / 1e6, self._ready, (src, tag, seq), slot)
            else:
                with slot.lock:
                    slot.ready = True
                self._complete((src, tag, seq), slot)

    def _peer_closed(self, src: int) -> None:
        """`src` closed its transport: its incomplete messages, and any recv posted later that finds
        no complete message, fail at once instead of waiting for the timeout."""
        err = ConnectionError(f"{self.describe(src)} closed its transport")
        with self._lock:
            self._lost[src] = err
            pending = [(k, sl) for k, sl in self._slots.items() if k[0] == src]
        for key, slot in pending:
            with slot.lock:
                if slot.arrived:
                    continue
                slot.error = slot.error or err
            self._complete(key, slot)

    def _complete(self, key: tuple[int, int, int], slot: _Slot) -> None:
        """Finish a message if both its bytes and its recv are there."""
        with slot.lock:
            work = slot.work
            if work is None or work.is_completed():
                return
            if slot.error is None and not slot.ready:
                return
            error = slot.error
            if error is None:
                try:
                    if slot.buffer is not None and slot.total:
                        dst = slot.staging if slot.staging is not None else slot.target
                        dst.detach().reshape(-1).view(torch.uint8).copy_(torch.frombuffer(slot.buffer,
                                                                                          dtype=torch.uint8))
                    if slot.staging is not None:
                        slot.target.copy_(slot.staging)
                except RuntimeError as e:
                    error = e
        with self._lock:
            self._slots.pop(key, None)
        work._finish(error)

    def _ready(self, key: tuple[int, int, int], slot: _Slot) -> None:
        with slot.lock:
            slot.ready = True
        self._complete(key, slot)
