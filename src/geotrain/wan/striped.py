"""StripedTransport: one tensor over K TCP connections, reassembled in order and verified.

On a WAN one TCP connection is window/RTT bound, so a cross-DC transfer is split into K contiguous
chunks sent on K connections at once (Atlas). Implements the runtime's Transport contract
(`send(tensor, dst, tag) -> Work`, `recv(tensor, src, tag) -> Work`, both non-blocking; messages
of one (src, dst, tag) are matched in the order sent).

Wire format, per chunk: a fixed struct header, the raw tensor bytes, the chunk's crc32 -- never pickle:
    HEADER = (magic, tag, seq, chunk index, chunk count, total bytes, offset, nbytes, delay us)
    TRAILER = (crc32,)
The crc trails the bytes so both ends compute it block by block while streaming (one pass over
cache-hot data, overlapped with the network) instead of in a separate pass before sending.
`seq` numbers the messages of one (src, dst, tag); the receiver writes each chunk straight into the
posted tensor's memory at `offset` (or into a buffer until the matching `recv` is posted), checks
its crc32 and the sizes, and completes the recv when every chunk arrived. Each connection carries
one direction (sender -> receiver) and starts with a hello naming the sender's rank and stripe.

Rendezvous: every rank listens on `host`:ephemeral and publishes "host:port" in a torch.distributed
Store (the runtime's default store, or any object with set/get). Connections are opened lazily on
the first send to a peer, bound to consecutive even source ports (see `sockets`).

Per destination, a dispatcher thread sends messages one after another: it consults the optional
temporal-sharing `turns(dst)` (acquire before, release after the last byte is written), then hands
the chunks to one writer thread per connection, each paced by the optional user-space shaper.
"""

from __future__ import annotations

import heapq
import queue
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from geotrain.wan.sockets import open_connections, recv_exact, tune

MAGIC = 0x47545350                      # "GTSP"
HEADER = struct.Struct("!IqQHHQQQI")
TRAILER = struct.Struct("!I")
HELLO = struct.Struct("!IiH")           # magic, sender rank, stripe index
BLOCK = 1 << 20                         # bytes per sendall when not shaped


class TransportError(RuntimeError):
    """A transfer failed: connection lost, corrupt chunk (crc), size mismatch or timeout."""


class Work:
    """Completion handle; `wait()` blocks, re-raises a transfer error, returns True."""

    def __init__(self, what: str, timeout_s: float):
        self.what = what
        self.timeout_s = timeout_s
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.finished_at: float | None = None   # wall clock (time.time()) when it completed

    def _finish(self, error: BaseException | None = None) -> None:
        if self._done.is_set():
            return
        self._error = error
        self.finished_at = time.time()
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        limit = self.timeout_s if timeout is None else timeout
        if not self._done.wait(limit):
            raise TransportError(f"{self.what}: timed out after {limit:.0f} s (did the peer rank stop?)")
        if self._error is not None:
            raise TransportError(f"{self.what}: {self._error}") from self._error
        return True


def _byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (any dtype, bf16 included), without a copy."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def _chunks(nbytes: int, k: int, min_chunk: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of up to k near-equal contiguous pieces, none smaller than min_chunk."""
    n = max(1, min(k, nbytes // max(1, min_chunk)))
    bounds = [nbytes * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(n)]


@dataclass
class _Slot:
    """One incoming message (src, tag, seq): where its bytes go, and how many chunks are still due."""

    total: int
    view: memoryview | None = None          # the posted tensor's bytes (when contiguous)
    buffer: bytearray | None = None         # bytes that arrived before the recv was posted
    target: torch.Tensor | None = None      # posted tensor
    staging: torch.Tensor | None = None     # contiguous staging for a non-contiguous target
    work: Work | None = None
    nchunks: int = -1
    arrived: int = 0
    ready: bool = False                     # every chunk arrived and its (shaper) delay has passed
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Peer:
    """Outgoing side towards one destination rank: K connections, writer threads, a dispatcher."""

    def __init__(self, owner: StripedTransport, dst: int):
        self.owner = owner
        self.dst = dst
        self.messages: queue.Queue = queue.Queue()
        self.socks: list[socket.socket] = []
        self.lanes: list[queue.Queue] = []
        threading.Thread(target=self._dispatch, name=f"striped-to-{dst}", daemon=True).start()

    def _connect(self) -> None:
        o = self.owner
        host, port = o._lookup(self.dst)
        k = o.connections_for(self.dst)
        self.socks = o._open(host, port, k, bind_host=o.host)
        for s in self.socks:
            _limit_unsent(s)
        shaper_cfg = o.shaper_for(self.dst)
        shaper = shaper_cfg.pacing() if shaper_cfg is not None and shaper_cfg.active else None
        for i, s in enumerate(self.socks):
            s.sendall(HELLO.pack(MAGIC, o.rank, i))
            lane: queue.Queue = queue.Queue()
            self.lanes.append(lane)
            pacing = shaper.connection() if shaper is not None else None
            delay_us = int(shaper_cfg.delay_ms * 1000) if shaper is not None else 0
            threading.Thread(target=self._write, args=(s, lane, pacing, delay_us), daemon=True,
                             name=f"striped-to-{self.dst}-{i}").start()

    def _dispatch(self) -> None:
        while True:
            item = self.messages.get()
            if item is None:
                return
            tensor, tag, seq, work = item
            turns = None
            try:
                if not self.socks:
                    self._connect()
                turns = self.owner.turns_for(self.dst)
                if turns is not None:
                    turns.acquire()
                data = _byte_view(tensor)
                pieces = _chunks(len(data), len(self.socks), self.owner.min_chunk_bytes)
                done = _Countdown(len(pieces))
                for i, (off, n) in enumerate(pieces):
                    piece = data[off:off + n]
                    hdr = [tag, seq, i, len(pieces), len(data), off, n]
                    self.lanes[i % len(self.lanes)].put((hdr, piece, done))
                done.wait()
                error = done.error
            except BaseException as e:  # noqa: BLE001 -- the error belongs to the caller's Work
                error = e
            if turns is not None:
                # Release before completing: once the caller sees its sends done, its turns are
                # given back too (it may close the link's arbiter right after).
                try:
                    turns.release()
                except OSError as e:
                    error = error or e
            work._finish(error)

    @staticmethod
    def _write(sock: socket.socket, lane: queue.Queue, pacing, delay_us: int) -> None:
        while True:
            item = lane.get()
            if item is None:
                return
            hdr, piece, done = item
            try:
                sock.sendall(HEADER.pack(MAGIC, *hdr, delay_us))
                step = 64 << 10 if pacing is not None else BLOCK
                crc = 0
                for off in range(0, len(piece), step):
                    block = piece[off:off + step]
                    crc = zlib.crc32(block, crc)
                    if pacing is not None:
                        pacing.wait_for(len(block))
                    sock.sendall(block)
                sock.sendall(TRAILER.pack(crc))
                done.tick()
            except OSError as e:
                done.tick(e)

    def close(self) -> None:
        self.messages.put(None)
        for lane in self.lanes:
            lane.put(None)
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


NOTSENT_LOWAT = 16 << 10     # bytes a connection may hold unsent in the kernel


def _limit_unsent(sock: socket.socket) -> None:
    """Keep at most NOTSENT_LOWAT unsent bytes queued in the kernel, so `sendall` returning means the
    bytes are on the wire (in flight), not parked in a multi-MB socket buffer: a temporal-sharing
    turn then ends when its transfer has left, not while most of it still waits to be sent."""
    opt = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, opt, NOTSENT_LOWAT)
    except OSError:
        pass


class _Countdown:
    def __init__(self, n: int):
        self.n = n
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def tick(self, error: BaseException | None = None) -> None:
        with self.cond:
            self.n -= 1
            self.error = self.error or error
            self.cond.notify_all()

    def wait(self) -> None:
        with self.cond:
            while self.n > 0:
                self.cond.wait()


class StripedTransport:
    """Multi-connection point-to-point transport (see module docstring).

    connections: K per destination (int, or a function of the destination rank).
    shaper: a pacing hook per destination (or a function of the destination returning one or None):
        an object with `active`, `delay_ms` and `pacing()`, whose `connection()` gives each connection
        a `wait_for(nbytes)` -- the emulation's user-space shaper (geotrain.emulation.shaper) plugs in
        here; None (a real WAN, or the kernel emulation) sends at the wire's pace.
    connect: opens the K connections to a peer (default `sockets.open_connections`, plain sockets);
        the kernel emulation passes its source-port-spreading variant.
    turns: temporal link sharing, a function dst -> object with acquire()/release(), or None.
    """

    def __init__(self, rank: int, store, *, host: str = "127.0.0.1",
                 connections: int | Callable[[int], int] = 4,
                 shaper: object | Callable[[int], object | None] | None = None,
                 turns: Callable[[int], object | None] | None = None,
                 prefix: str = "geotrain/striped", min_chunk_bytes: int = 64 << 10, timeout_s: float = 600.0,
                 connect: Callable[..., list[socket.socket]] = open_connections):
        self.rank = rank
        self.store = store
        self.host = host
        self.prefix = prefix
        self.min_chunk_bytes = min_chunk_bytes
        self.timeout_s = timeout_s
        self._connections = connections
        self._shaper = shaper
        self._open = connect
        self._turns = turns
        self._lock = threading.Lock()
        self._peers: dict[int, _Peer] = {}
        self._send_seq: dict[tuple[int, int], int] = {}
        self._recv_seq: dict[tuple[int, int], int] = {}
        self._slots: dict[tuple[int, int, int], _Slot] = {}
        self._lost: dict[int, BaseException] = {}        # peers whose connection dropped
        self._timers: list[tuple[float, int, _Slot]] = []
        self._timer_cv = threading.Condition()
        self._timer_seq = 0
        self._closed = False
        self._conns: list[socket.socket] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        store.set(f"{prefix}/{rank}", f"{host}:{self.port}")
        threading.Thread(target=self._accept, name="striped-accept", daemon=True).start()
        threading.Thread(target=self._run_timers, name="striped-delay", daemon=True).start()

    # ------------------------------------------------------------------ configuration lookups
    def connections_for(self, dst: int) -> int:
        k = self._connections(dst) if callable(self._connections) else self._connections
        return max(1, int(k))

    def shaper_for(self, dst: int):
        return self._shaper(dst) if callable(self._shaper) else self._shaper

    def turns_for(self, dst: int):
        return self._turns(dst) if self._turns is not None else None

    def _lookup(self, rank: int) -> tuple[str, int]:
        raw = self.store.get(f"{self.prefix}/{rank}")
        host, _, port = (raw.decode() if isinstance(raw, bytes) else str(raw)).rpartition(":")
        return host, int(port)

    # ------------------------------------------------------------------ Transport API
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        if dst == self.rank:
            raise ValueError("a transport sends only to other ranks")
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            seq = self._send_seq.get((dst, tag), 0)
            self._send_seq[(dst, tag)] = seq + 1
            peer = self._peers.get(dst)
            if peer is None:
                peer = self._peers[dst] = _Peer(self, dst)
        work = Work(f"send to rank {dst} (tag {tag}, {t.numel() * t.element_size()} bytes)", self.timeout_s)
        peer.messages.put((t, tag, seq, work))
        return work

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        nbytes = tensor.numel() * tensor.element_size()
        work = Work(f"recv from rank {src} (tag {tag}, {nbytes} bytes)", self.timeout_s)
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
                    slot.view = _byte_view(staging if staging is not None else tensor)
                finished = slot.ready or slot.error is not None
        if finished:
            self._complete(key, slot)
        return work

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
        for p in peers:
            p.close()
        try:
            self._listener.close()
        except OSError:
            pass
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        with self._timer_cv:
            self._timer_cv.notify_all()

    def __enter__(self) -> StripedTransport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ receiving side
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            tune(conn)
            self._conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), name="striped-read", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        hello = bytearray(HELLO.size)
        hdr = bytearray(HEADER.size)
        src = None
        try:
            recv_exact(conn, memoryview(hello))
            magic, src, _stripe = HELLO.unpack(hello)
            if magic != MAGIC:
                src = None
                raise ConnectionError("not a striped-transport peer")
            while True:
                recv_exact(conn, memoryview(hdr))
                self._read_chunk(conn, src, HEADER.unpack(hdr))
        except (OSError, ConnectionError) as e:
            conn.close()
            if src is not None and not self._closed:
                self._peer_lost(src, e)

    def _peer_lost(self, src: int, why: BaseException) -> None:
        """A connection from `src` dropped: its incomplete messages, and any recv posted later that
        finds no complete message, fail at once instead of waiting for the timeout."""
        err = ConnectionError(f"rank {src} dropped the connection ({why})")
        with self._lock:
            self._lost[src] = err
            pending = [(k, sl) for k, sl in self._slots.items() if k[0] == src]
        for key, slot in pending:
            with slot.lock:
                if slot.ready:
                    continue
                slot.error = slot.error or err
            self._complete(key, slot)

    def _read_chunk(self, conn: socket.socket, src: int, h: tuple) -> None:
        magic, tag, seq, index, nchunks, total, offset, nbytes, delay_us = h
        if magic != MAGIC or offset + nbytes > total or index >= nchunks:
            raise ConnectionError(f"corrupt header from rank {src}")
        key = (src, tag, seq)
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot(total=total, buffer=bytearray(total))
                slot.view = memoryview(slot.buffer)
        with slot.lock:
            slot.nchunks = nchunks
            if slot.total != total:
                slot.error = slot.error or ValueError(f"size mismatch: sender sent {total} bytes, "
                                                      f"receiver expects {slot.total}")
            view = slot.view if slot.error is None else None
        if view is None:                                 # drain the bytes of a failed message
            view = memoryview(bytearray(nbytes))
            offset = 0
        piece = view[offset:offset + nbytes]
        crc = 0
        for off in range(0, nbytes, BLOCK):
            block = piece[off:off + BLOCK]
            recv_exact(conn, block)
            crc = zlib.crc32(block, crc)
        trailer = bytearray(TRAILER.size)
        recv_exact(conn, memoryview(trailer))
        bad = TRAILER.unpack(trailer)[0] != crc
        with slot.lock:
            if bad:
                slot.error = slot.error or ValueError(f"crc32 mismatch in chunk {index} of {nchunks}")
            slot.arrived += 1
            finished = slot.arrived == slot.nchunks
        if finished:
            if delay_us:
                self._schedule(time.monotonic() + delay_us / 1e6, key, slot)
            else:
                with slot.lock:
                    slot.ready = True
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
                    if slot.buffer is not None:
                        src_bytes = torch.frombuffer(slot.buffer, dtype=torch.uint8) if slot.total else None
                        if src_bytes is not None:
                            dst = slot.staging if slot.staging is not None else slot.target
                            dst.detach().reshape(-1).view(torch.uint8).copy_(src_bytes)
                    if slot.staging is not None:
                        slot.target.copy_(slot.staging)
                except RuntimeError as e:
                    error = e
        with self._lock:
            self._slots.pop(key, None)
        work._finish(error)

    def _schedule(self, due: float, key, slot: _Slot) -> None:
        with self._timer_cv:
            self._timer_seq += 1
            heapq.heappush(self._timers, (due, self._timer_seq, (key, slot)))
            self._timer_cv.notify()

    def _run_timers(self) -> None:
        """Completes shaper-delayed messages at their due time (the fallback's one-way latency)."""
        while not self._closed:
            with self._timer_cv:
                while not self._timers and not self._closed:
                    self._timer_cv.wait(1.0)
                if self._closed:
                    return
                due, _, (key, slot) = self._timers[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._timer_cv.wait(wait)
                    continue
                heapq.heappop(self._timers)
            with slot.lock:
                slot.ready = True
            self._complete(key, slot)
