"""Prefill on training ranks, inside their bubbles.

The service side (`BubbleExecutor`) keeps the FIFO of accepted requests and hands a rank that
reaches a bubble (`BubbleWorker.fill(budget)`) the longest piece of the oldest request its fitted
prefill cost says will finish inside the budget; a started request stays on its rank (its KV
cache grows there) until it sends the first token back. Training never waits for prefill: a rank
never waits for the service past the budget, nor starts a chunk predicted to outlast the bubble.
Only this run's ranks connect: `transport.auth`'s handshake on a local socket.
"""

from __future__ import annotations

import collections
import select
import socket
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from geotrain.bubbletea.executor import PrefillOutput
from geotrain.bubbletea.idle_priority import IdlePriorityThread
from geotrain.bubbletea.inference import KVCache, forward_with_cache, prefill
from geotrain.bubbletea.prefill_cost import PrefillCost
from geotrain.bubbletea.wire import ProtocolError, recv_frame, send_frame
from geotrain.models.llama import UnitStack
from geotrain.transport.admission import Gate, accept_loop
from geotrain.transport.auth import ANY_RANK, BUBBLETEA, DropLog, client_handshake, new_secret, server_handshake


@dataclass
class _Job:
    id: int
    tokens: list[int]
    future: Future
    done: int = 0                 # tokens prefilled so far
    owner: int | None = None      # rank holding its KV cache
    busy_s: float = 0.0


@dataclass
class _RankState:
    cost: PrefillCost
    current: int | None = None    # job id in progress on this rank


def _nodelay(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class BubbleExecutor:
    """unix_path: listen on a Unix socket instead of TCP -- it reaches ranks that run inside
    emulated datacenters' network namespaces, where 127.0.0.1 is not the launcher's.

    Only ranks of this run may connect: the executor's secret is written to a 0600 file the ranks
    read, and a connection that fails `transport.auth`'s handshake, or whose hello names another
    rank than it proved, is logged in one line and dropped. The socket is local, so the opener is
    what needs proving; the frames after it are not MAC'd. Openers are admitted through
    `transport.admission.Gate` (a handshake deadline bytes do not extend, a per-address cap), as the
    WAN listeners are: a hello dripped a byte at a time held a thread and a descriptor each. A late
    answer from a rank is dropped: the service counts tokens as done only when the rank reports them."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, min_chunk: int = 8, unix_path: str | None = None,
                 secret: bytes | None = None):
        self.min_chunk = min_chunk
        self.secret = secret or new_secret()         # what a rank must prove it holds (BubbleWorker.secret)
        self.drops = DropLog("executor", prefix="geotrain bubbletea")
        self.gate = Gate()
        self._lock = threading.Lock()
        self._pending: collections.deque[_Job] = collections.deque()
        self._jobs: dict[int, _Job] = {}
        self.ranks: dict[int, _RankState] = {}       # connected ranks
        self._busy_total = 0.0                        # prefill seconds over every rank ever seen
        self._bubble: dict[int, float] = {}           # per rank: measured bubble seconds (prefill + wait)
        self._ranks_seen: set[int] = set()
        self._t0 = time.monotonic()
        if unix_path is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.bind(unix_path)
            self._sock.listen(256)
            self.address: str | tuple = unix_path
        else:
            self._sock = socket.create_server((host, port))
            self.address = self._sock.getsockname()[:2]
        self._closed = False
        threading.Thread(target=self._accept_loop, name="bubble-executor", daemon=True).start()

    # -- executor interface ----------------------------------------------------------------
    def submit(self, request_id: int, tokens: list[int]) -> Future:
        fut: Future = Future()
        job = _Job(request_id, list(tokens), fut)
        with self._lock:
            self._jobs[request_id] = job
            self._pending.append(job)
        return fut

    def ready(self) -> bool:
        """A training rank has joined: an accepted request can make progress. (Requests that
        arrive after the last rank left are still accepted: `finish_locally` answers them.)"""
        with self._lock:
            return bool(self._ranks_seen)

    def utilization_gained(self) -> float:
        with self._lock:
            busy, n = self._busy_total, max(1, len(self._ranks_seen))
        return busy / (n * max(1e-9, time.monotonic() - self._t0))

    def bubble_seconds(self) -> tuple[float, float]:
        """(prefill seconds, bubble seconds) summed over ranks, as the ranks last reported: the
        bubble is the time a rank spent where it would wait for data, prefill included."""
        with self._lock:
            return self._busy_total, sum(self._bubble.values())

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def finish_locally(self, model: UnitStack, grace_s: float = 5.0) -> int:
        """Training is over: prefill every request still queued (or orphaned by a departed
        rank) here, so no accepted request is lost. Returns how many were finished."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:  # let departing ranks hand back their requests
            with self._lock:
                if not self.ranks:
                    break
            time.sleep(0.05)
        n = 0
        while True:
            with self._lock:
                job = self._pending.popleft() if self._pending else None
                if job is not None:
                    self._jobs.pop(job.id, None)
            if job is None:
                return n
            if not job.future.running() and not job.future.set_running_or_notify_cancel():
                continue
            t = time.perf_counter()
            first, cache = prefill(model, job.tokens)
            data, shape, dtype = cache.to_bytes()
            job.future.set_result(PrefillOutput(first, data, shape, dtype, time.perf_counter() - t, where="launcher"))
            n += 1

    # -- rank connections ------------------------------------------------------------------
    def _accept_loop(self) -> None:
        """Through transport.admission's loop: a launcher out of descriptors (a flood on the HTTP
        port) backs off and accepts again -- returning on any OSError left ranks that (re)join
        later, an elastic run's restarted ones, without a way in."""
        accept_loop(self._sock, lambda: self._closed, self._start_rank,
                    lambda line: print(f"geotrain bubbletea: executor: {line}", file=sys.stderr, flush=True))

    def _start_rank(self, conn: socket.socket, addr) -> None:
        _nodelay(conn)
        addr = addr if isinstance(addr, tuple) else ("unix", "socket")     # a Unix socket's peer is ''
        self.gate.serve(conn, addr, self._serve_rank, "bubble-rank", self.drops)

    def _serve_rank(self, conn: socket.socket, addr, ticket) -> None:
        rank = None
        try:
            proved, _, _ = server_handshake(conn, self.secret, BUBBLETEA, ANY_RANK)
        except (OSError, ConnectionError) as e:
            self.gate.done(ticket)
            conn.close()
            if not self._closed:
                self.drops(f"dropped a connection from {addr[0]}:{addr[1]}: {ticket.failure(e)}")
            return
        self.gate.done(ticket)
        try:
            hello, _ = recv_frame(conn)
            if int(hello["rank"]) != proved:
                raise ProtocolError(f"hello names rank {hello['rank']}, but the handshake proved rank {proved}")
            rank = proved
            a, b, c = (float(x) for x in hello["cost"])
            with self._lock:
                self.ranks[rank] = _RankState(PrefillCost(a, b, c))
                self._ranks_seen.add(rank)
            while True:
                msg, payload = recv_frame(conn)
                if msg.get("op") == "poll":
                    with self._lock:
                        self._bubble[rank] = max(self._bubble.get(rank, 0.0), float(msg.get("bubble_s", 0.0)))
                    send_frame(conn, self._next_chunk(rank, float(msg["budget"])))
                elif msg.get("op") == "done":
                    self._chunk_done(rank, msg, payload)
                else:
                    raise ProtocolError(f"unknown op {msg.get('op')!r}")
        except (ConnectionError, OSError):
            pass                                    # the rank left (training ended, or it died)
        except (ProtocolError, KeyError, ValueError, TypeError) as e:
            self.drops(f"dropped rank {proved}'s connection: {type(e).__name__}: {e}")
        finally:
            conn.close()
            if rank is not None:
                self._orphan(rank)

    def _next_chunk(self, rank: int, budget: float) -> dict:
        with self._lock:
            st = self.ranks[rank]
            job = self._jobs.get(st.current) if st.current is not None else None
            if job is None:
                while self._pending and self._pending[0].future.cancelled():
                    self._jobs.pop(self._pending.popleft().id, None)
                if not self._pending:
                    return {"op": "none"}
                job = self._pending[0]
            left = len(job.tokens) - job.done
            n = min(left, st.cost.max_chunk(budget, job.done))
            if n < min(left, self.min_chunk):
                return {"op": "none"}
            if job.owner is None:
                self._pending.popleft()
                job.owner, st.current = rank, job.id
                if not job.future.running() and not job.future.set_running_or_notify_cancel():
                    st.current = None  # cancelled by the service (timed out) before it started
                    self._jobs.pop(job.id, None)
                    return {"op": "none"}
            return {"op": "chunk", "id": job.id, "tokens": job.tokens[job.done:job.done + n],
                    "context": job.done, "last": job.done + n == len(job.tokens)}

    def _chunk_done(self, rank: int, msg: dict, payload: bytes) -> None:
        with self._lock:
            st = self.ranks[rank]
            job = self._jobs[int(msg["id"])]
            if job.owner != rank:
                raise ProtocolError("chunk result from a rank that does not own the request")
            job.done += int(msg["n"])
            busy = float(msg["busy"])
            job.busy_s += busy
            self._busy_total += busy
            finished = job.done >= len(job.tokens)
            if finished:
                st.current = None
                self._jobs.pop(job.id, None)
        if finished:
            job.future.set_result(PrefillOutput(int(msg["first_token"]), payload, list(msg["kv_shape"]),
                                                str(msg["kv_dtype"]), job.busy_s, where=f"rank {rank}"))

    def _orphan(self, rank: int) -> None:
        """A rank went away: its unfinished request restarts from scratch on another rank."""
        with self._lock:
            st = self.ranks.pop(rank, None)
            if st and st.current is not None and st.current in self._jobs:
                job = self._jobs[st.current]
                job.done, job.owner = 0, None   # its future stays running until a new owner ends it
                self._pending.appendleft(job)


@dataclass
class BubbleWorker:
    """The rank side: runs prefill chunks in the bubbles the runtime offers."""

    address: tuple[str, int] | str   # (host, port), or a Unix socket path
    rank: int
    model: UnitStack
    cost: PrefillCost
    margin_s: float = 0.0
    priority: str = "normal"         # "idle": compute on a SCHED_IDLE thread (CPU ranks; see idle_priority)
    secret: bytes = b""              # the executor's secret (BubbleExecutor.secret): proves this rank may join
    busy_s: float = 0.0
    chunks: int = 0
    predicted_s: float = 0.0         # what the cost model said the chunks run would take
    late_s: float = 0.0              # how far fills ran past their budget, summed
    bubble_s: float = 0.0            # time spent where the rank waits for data (prefill + wait), summed
    slowdown: float = 1.0            # measured / predicted chunk time, learnt (see _learn)
    slowdown_half_life_s: float = 1.0   # while no chunk runs, the learnt slow-down decays toward 1 (see _forget)
    _caches: dict[int, KVCache] = field(default_factory=dict)
    _sock: socket.socket | None = None
    _runner: IdlePriorityThread | None = None
    _unanswered: int = 0             # polls whose answers came too late (still to be read and dropped)
    _slowdown_at: float | None = None   # when `slowdown` was last learnt or decayed (perf_counter)

    def connect(self) -> None:
        if isinstance(self.address, str):
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.connect(self.address)
        else:
            self._sock = socket.create_connection(tuple(self.address))
        _nodelay(self._sock)
        try:
            client_handshake(self._sock, self.secret, BUBBLETEA, self.rank, ANY_RANK)
        except OSError:
            self._sock.close()
            self._sock = None
            raise
        send_frame(self._sock, {"rank": self.rank, "cost": [self.cost.a, self.cost.b, self.cost.c]})
        if self.priority == "idle" and self._runner is None:
            self._runner = IdlePriorityThread()

    def fill(self, budget_s: float) -> float:
        """Run prefill chunks for at most `budget_s` seconds (minus the margin); returns the
        time spent, including the round trips."""
        if self._sock is None:
            return 0.0
        t0 = time.perf_counter()
        if self._runner is not None:
            self._runner.run(lambda: self._fill_until(t0, budget_s))
        else:
            self._fill_until(t0, budget_s)
        used = time.perf_counter() - t0
        self.late_s += max(0.0, used - budget_s)
        return used

    def _fill_until(self, t0: float, budget_s: float) -> None:
        deadline = t0 + budget_s - self.margin_s
        self._forget(t0)
        while True:
            left = deadline - time.perf_counter()
            if left <= self.cost.a:
                return
            send_frame(self._sock, {"op": "poll", "budget": left / self.slowdown, "bubble_s": self.bubble_s})
            msg = self._reply(deadline)
            if msg is None:          # the service was slow to answer: the bubble is over, not training
                self._unanswered += 1
                return
            if msg.get("op") != "chunk":
                return
            # A proposal is only a proposal: the service counts tokens as done when told, so a
            # chunk that no longer fits (the reply came late) is left for the next bubble.
            if self._predict(msg) > deadline - time.perf_counter():
                return
            self._run_chunk(msg)

    def _reply(self, deadline: float) -> dict | None:
        """The answer to the latest poll, or None if it has not come by `deadline`. Answers to
        polls given up on earlier arrive first, in order, and are dropped."""
        while True:
            wait = deadline - time.perf_counter()
            if wait <= 0 or not select.select([self._sock], [], [], wait)[0]:
                return None
            msg, _ = recv_frame(self._sock)   # a frame is sent whole: once readable, it is all there soon
            if self._unanswered:
                self._unanswered -= 1
                continue
            return msg

    def _modelled(self, msg: dict) -> float:
        """The chunk's time by the start-up profile."""
        return self.cost.chunk_time(len(msg["tokens"]), int(msg["context"]))

    def _predict(self, msg: dict) -> float:
        return self._modelled(msg) * self.slowdown

    def _forget(self, now: float) -> None:
        """Let the learnt slow-down decay toward 1 with the time since it was last measured. Only a
        chunk that runs measures it, and a slow-down too large for the rank's bubbles lets no chunk
        run: without this, one slow chunk (a cold first forward, a burst of load) locked the rank
        out of every bubble of that size for good -- on a loaded 2-core machine both ranks of a
        test stopped taking work and the requests waited for the service's timeout."""
        if self._slowdown_at is not None and self.slowdown > 1.0:
            halves = (now - self._slowdown_at) / max(self.slowdown_half_life_s, 1e-9)
            self.slowdown = 1.0 + (self.slowdown - 1.0) * 0.5 ** halves
        self._slowdown_at = now

    def _learn(self, measured: float, modelled: float) -> None:
        """Track how much slower chunks run now than the start-up profile said (a busy machine,
        cold caches after a training step): quick to rise, slow to fall, never below 1."""
        self.predicted_s += modelled * self.slowdown
        r = measured / max(modelled, 1e-9)
        w = 0.5 if r > self.slowdown else 0.05
        self.slowdown = max(1.0, (1 - w) * self.slowdown + w * r)
        self._slowdown_at = time.perf_counter()

    def _run_chunk(self, msg: dict) -> None:
        rid = int(msg["id"])
        cache = self._caches.setdefault(rid, KVCache())
        if cache.length != int(msg["context"]):
            raise ProtocolError(f"request {rid}: cache holds {cache.length} tokens, chunk starts at {msg['context']}")
        t = time.perf_counter()
        logits = forward_with_cache(self.model, torch.tensor([msg["tokens"]], dtype=torch.long), cache)
        busy = time.perf_counter() - t
        self._learn(busy, self._modelled(msg))
        self.busy_s += busy
        self.chunks += 1
        done = {"op": "done", "id": rid, "n": len(msg["tokens"]), "busy": busy}
        if msg["last"]:
            data, shape, dtype = self._caches.pop(rid).to_bytes()
            send_frame(self._sock, {**done, "first_token": int(torch.argmax(logits)), "kv_shape": shape,
                                    "kv_dtype": dtype}, data)
        else:
            send_frame(self._sock, done)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._runner is not None:
            self._runner.close()
            self._runner = None
