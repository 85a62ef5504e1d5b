"""The sending side of the striped transport: one `Peer` per destination rank.

A dispatcher thread sends the destination's messages one after another: it takes the link's
temporal-sharing turn (if any), splits the message into one contiguous chunk per connection and
hands each chunk to that connection's writer thread, which sends it as authenticated DATA frames
(paced by the optional user-space shaper); with a turn it then holds the turn until the
connections' unacknowledged bytes are down to the turn's `handoff` (`transport.turns`: the bytes
still queued in the network would otherwise share the bottleneck with the next holder's).
A message stays in `unacked` until the receiver's ACK comes back on any connection; its Work
completes then (or, if the ACK beat the dispatcher's release of the message's turn, at that
release), so `wait()` means "the peer has the bytes" and any turn it took is free again.

When a connection breaks (reset, a frame the receiver refused, EOF), the dispatcher closes all of
the destination's connections, reconnects with a fresh handshake (backing off up to 2 s) and
resends every unacknowledged message whole, in order; the receiver drops what it already has.
A link that stays down `timeout_s` fails the messages it holds, with an error naming it.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass

from geotrain.transport.auth import (
    HANDSHAKE_TIMEOUT_S,
    STRIPED,
    Channel,
    ProtocolError,
    SecretMismatch,
    client_handshake,
)
from geotrain.transport.sockets import close_quietly, unacknowledged_bytes
from geotrain.transport.striped_frames import (
    ACK,
    BYE,
    DATA,
    FRAME,
    FRAME_BYTES,
    Countdown,
    TransportError,
    Work,
    chunks,
    frame_payload,
)

NOTSENT_LOWAT = 16 << 10     # bytes a connection may hold unsent in the kernel
BLOCK = 1 << 20              # bytes per sendall when not shaped
PACED_BLOCK = 64 << 10       # bytes per sendall when shaped
SECRET_MISMATCHES = 3        # handshakes refused for the secret in a row before the link is given up (not a blip)


@dataclass
class Outgoing:
    msg: int
    tag: int
    seq: int
    data: memoryview
    work: Work
    keep: object = None          # the tensor `data` views (alive until acknowledged)
    written_at: float | None = None
    in_turn: bool = False        # its sender holds the link's turn for it (Peer.lock)
    acked_in_turn: bool = False  # its ACK came while it did: the Work completes at the release


@dataclass
class _Broken:
    generation: int
    why: BaseException


def limit_unsent(sock: socket.socket) -> None:
    """Keep at most NOTSENT_LOWAT unsent bytes queued in the kernel, so `sendall` returning means the
    bytes are on the wire (in flight), not parked in a multi-MB socket buffer: a temporal-sharing
    turn then ends when its transfer has left, not while most of it still waits to be sent."""
    opt = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, opt, NOTSENT_LOWAT)
    except OSError:
        pass


class _Lane:
    """One connection: a writer thread for DATA/BYE frames, a reader thread for ACKs."""

    def __init__(self, peer: Peer, sock: socket.socket, channel: Channel, pacing, delay_us: int, generation: int):
        self.peer, self.sock, self.channel = peer, sock, channel
        self.pacing, self.delay_us, self.generation = pacing, delay_us, generation
        self.jobs: queue.Queue = queue.Queue()
        self.writer = threading.Thread(target=self._write, daemon=True, name=f"striped-to-{peer.dst}")
        self.writer.start()
        threading.Thread(target=self._read_acks, daemon=True, name=f"striped-acks-{peer.dst}").start()

    def _write(self) -> None:
        block = PACED_BLOCK if self.pacing is not None else BLOCK
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job == "bye":
                try:
                    self.channel.send(FRAME.pack(BYE, 0, 0, 0, 0, 0, 0, 0))
                except OSError:
                    pass
                return
            out, off, n, done = job
            pace = self._pace_job() if self.pacing is not None else None
            try:
                total = len(out.data)
                for start in range(off, off + n, FRAME_BYTES) if n else (off,):
                    size = min(FRAME_BYTES, off + n - start)
                    hdr = FRAME.pack(DATA, out.msg, out.tag, out.seq, total, start, size, self.delay_us)
                    self.channel.send(hdr, out.data[start:start + size], block=block, pace=pace)
                done.tick()
            except OSError as e:
                done.tick(e)

    def _pace_job(self):
        """pace(nbytes) for one job's blocks: the first is booked from now, each later one follows
        the one before (they are all ready: see ConnectionShaper.wait_for)."""
        first = [True]

        def pace(nbytes: int) -> None:
            self.pacing.wait_for(nbytes, follows=not first[0])
            first[0] = False
        return pace

    def _read_acks(self) -> None:
        try:
            while True:
                fields, _ = self.channel.recv(FRAME, frame_payload, 0)
                if fields[0] != ACK:
                    raise ProtocolError(f"unexpected frame kind {fields[0]} from the receiver")
                self.peer.acked(fields[1])
        except (OSError, ConnectionError) as e:
            self.peer.lane_broken(self.generation, e)

    def close(self, bye: bool = False) -> None:
        self.jobs.put("bye" if bye else None)
        if bye:
            self.writer.join(timeout=2.0)
        close_quietly(self.sock)


class Peer:
    """Outgoing side towards one destination rank (see module docstring)."""

    def __init__(self, owner, dst: int):
        self.owner, self.dst = owner, dst
        self.queue: queue.Queue = queue.Queue()
        self.unacked: dict[int, Outgoing] = {}
        self.lock = threading.Lock()
        self.lanes: list[_Lane] = []
        self.generation = 0
        self.closing = False
        self.dead: BaseException | None = None
        self.next_msg = 0
        self.oversleep_s = 0.0           # how late this host's sleeps wake, on average (_drain)
        threading.Thread(target=self._dispatch, name=f"striped-dispatch-{dst}", daemon=True).start()

    # ---------------------------------------------------------------- called by other threads
    def submit(self, out: Outgoing) -> None:
        self.queue.put(out)

    def acked(self, msg: int) -> None:
        with self.lock:
            out = self.unacked.pop(msg, None)
            if out is not None and out.in_turn:
                out.acked_in_turn = True     # the caller may see it done only once the turn is released
                return
        if out is not None:
            out.work._finish(None, at=out.written_at or time.time())

    def lane_broken(self, generation: int, why: BaseException) -> None:
        if not self.closing:
            self.queue.put(_Broken(generation, why))

    def close(self) -> None:
        self.closing = True
        self.queue.put(None)
        for lane in self.lanes:
            lane.close(bye=True)

    # ---------------------------------------------------------------- dispatcher thread
    def _dispatch(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if isinstance(item, _Broken):
                if item.generation == self.generation:
                    self._recover(item.why)
                continue
            self._send(item)

    def _send(self, out: Outgoing) -> None:
        if self.dead is not None or self.closing:
            out.work._finish(self.dead or TransportError("transport is closed"))
            return
        with self.lock:
            self.unacked[out.msg] = out
        turns = self.owner.turns_for(self.dst)
        if not self.lanes and turns is not None:
            # Connect before taking the turn: handshakes cost round trips, not link capacity (d
            # pipelines connecting one after the other inside their turns took 3.6 s instead of 1.4).
            try:
                self._connect()
            except (OSError, ConnectionError):
                pass                     # retried (and reported) inside the turn as before
        try:
            if turns is not None:
                turns.acquire()
        except BaseException as e:  # noqa: BLE001 -- the error belongs to the caller's Work
            with self.lock:
                self.unacked.pop(out.msg, None)
            out.work._finish(e)
            return
        if turns is not None:
            with self.lock:
                out.in_turn = True
        out.work.started_at = time.time()      # on the link from here (the trace's transfer start)
        try:
            error = None
            try:
                if not self.lanes:
                    self._connect()
                error = self._write(out)
                if error is None and turns is not None:
                    self._drain(getattr(turns, "handoff", None), out)
            except (OSError, ConnectionError) as e:
                error = e
        finally:
            if turns is not None:
                # Release before the caller sees its sends done: it may close the link's arbiter right after.
                # (The ACK may have come first, on another thread: then the Work completes here.)
                try:
                    turns.release()
                except OSError as e:
                    self.owner.say(f"link to {self.owner.describe(self.dst)}: releasing its turn failed ({e})")
                with self.lock:
                    out.in_turn, acked = False, out.acked_in_turn
                if acked:
                    out.work._finish(None, at=out.written_at or time.time())
        if error is not None:
            self._recover(error)

    def _connect(self) -> None:
        o = self.owner
        try:
            host, port = o.lookup(self.dst)
        except Exception as e:  # noqa: BLE001 -- the store's own errors (DistNetworkError...): retried as a reconnect
            raise ConnectionError(f"cannot look up {o.describe(self.dst)}'s address ({e})") from None
        socks = o.open_connections(host, port, o.connections_for(self.dst), bind_host=o.host)
        for s in socks:
            limit_unsent(s)
        try:
            if o.tls is not None:
                raw, socks = socks, []
                for s in raw:
                    socks.append(o.tls.wrap_client(s, HANDSHAKE_TIMEOUT_S))
            channels = [client_handshake(s, o.secret, STRIPED, o.rank, self.dst, i) for i, s in enumerate(socks)]
        except BaseException:
            for s in [*socks, *(raw if o.tls is not None else ())]:
                s.close()
            raise
        cfg = o.shaper_for(self.dst)
        shaper = cfg.pacing() if cfg is not None and cfg.active else None
        delay_us = int(cfg.delay_ms * 1000) if shaper is not None else 0
        self.lanes = [_Lane(self, s, ch, shaper.connection() if shaper is not None else None, delay_us,
                            self.generation) for s, ch in zip(socks, channels)]

    def _write(self, out: Outgoing) -> BaseException | None:
        """Send one message over the current connections; returns the error that broke one, if any."""
        pieces = chunks(len(out.data), len(self.lanes), self.owner.min_chunk_bytes)
        done = Countdown(len(pieces))
        for i, (off, n) in enumerate(pieces):
            self.lanes[i % len(self.lanes)].jobs.put((out, off, n, done))
        done.wait()
        if done.error is None:
            out.written_at = time.time()
        return done.error

    def _drain(self, handoff, out: Outgoing) -> None:
        """Hold the turn until the transfer has had the link for as long as it takes at the turn's
        rate (a transfer smaller than a round trip's worth of bytes leaves the socket at once, yet
        still occupies the bottleneck that long) and no more than rate x (RTT + lead) of what this
        peer's connections carry is unacknowledged (none still queued in the network); at most
        `stall_s`. Then the next holder's first bytes reach the bottleneck as these leave it.
        The lead is the grant's (`handoff.lead_s`) plus how late this thread's sleeps have been
        waking (`oversleep_s`, a running mean): on a busy host a turn held until the wake-up left
        the link idle -- tiny_2dc under load held 16 KiB turns 85 ms for 69 ms of bytes."""
        if handoff is None or handoff.bytes_per_s <= 0:
            return
        lead = handoff.lead_s + self.oversleep_s
        self._sleep_until((out.work.started_at or time.time()) + len(out.data) / handoff.bytes_per_s - lead)
        give_up = time.monotonic() + self.owner.stall_s
        while True:
            lead = handoff.lead_s + self.oversleep_s
            queued = (sum(unacknowledged_bytes(lane.sock) for lane in self.lanes)
                      - handoff.bytes_per_s * (handoff.rtt_s + lead))
            if queued <= 0 or time.monotonic() >= give_up:
                return
            self._sleep_until(time.time() + max(queued / handoff.bytes_per_s, 0.0005))   # drained at the turn's rate

    def _sleep_until(self, when: float) -> None:
        """Sleep until `when` (wall clock), and fold how late the wake-up came into `oversleep_s`."""
        left = when - time.time()
        if left <= 0:
            return
        time.sleep(left)
        late = max(0.0, time.time() - when)
        self.oversleep_s += 0.2 * (min(late, 0.05) - self.oversleep_s)

    def _drop_lanes(self) -> None:
        self.generation += 1
        lanes, self.lanes = self.lanes, []
        for lane in lanes:
            lane.close()

    def _recover(self, why: BaseException) -> None:
        """Reconnect and resend every unacknowledged message, until it works or `timeout_s` passed."""
        self._drop_lanes()
        o = self.owner
        name = o.describe(self.dst)
        with self.lock:
            pending = len(self.unacked)
        if not pending or self.closing:
            return                       # nothing in flight: reconnect on the next send
        o.say(f"link to {name}: connection lost ({why}); reconnecting to resend {pending} message(s)")
        start = last_report = time.monotonic()
        backoff = 0.05
        refused = 1 if isinstance(why, SecretMismatch) else 0
        while not self.closing:
            if refused >= SECRET_MISMATCHES:      # the peer's host holds another secret: waiting cannot mend it
                self._give_up(TransportError(f"link to {name}: {why}"))
                return
            with self.lock:
                todo = sorted(self.unacked.values(), key=lambda m: m.msg)
            if not todo:
                return
            try:
                self._connect()
                for out in todo:
                    error = self._write(out)
                    if error is not None:
                        raise error
                o.say(f"link to {name}: reconnected after {time.monotonic() - start:.1f} s, "
                      f"resent {len(todo)} message(s)")
                return
            except (OSError, ConnectionError) as e:
                self._drop_lanes()
                why = e
                refused = refused + 1 if isinstance(e, SecretMismatch) else 0
                if refused >= SECRET_MISMATCHES:
                    continue
            waited = time.monotonic() - start
            if waited >= o.timeout_s:
                self._give_up(TransportError(f"link to {name} stayed down for {waited:.0f} s ({why})"))
                return
            if time.monotonic() - last_report >= o.stall_s:
                last_report = time.monotonic()
                o.say(f"link to {name}: still down after {waited:.0f} s ({why}); retrying until "
                      f"{o.timeout_s:.0f} s")
            time.sleep(backoff)
            backoff = min(2 * backoff, 2.0)

    def _give_up(self, error: TransportError) -> None:
        self.dead = error
        with self.lock:
            failed, self.unacked = list(self.unacked.values()), {}
        for out in failed:
            out.work._finish(error)
