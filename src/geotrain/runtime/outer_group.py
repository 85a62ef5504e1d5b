"""The outer exchange of DiLoCo: one rank per worker (the same rank of every worker's layout, so
the same parameters) averaging a vector over the authenticated striped transport.

An exchange is a reduce-scatter and an all-gather directly between the members (one hop each,
no ring's chained latencies): member j owns part j, sums every member's part j in fp32 in member
order, encodes the mean once and sends those bytes to all -- so every worker holds the same
average, bit for bit, whatever the codec. Membership survives a lost worker and admits a
restarted one (`OuterGroup`): survivors either all apply an attempt's average or all retry, so
their parameters never diverge.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import torch

from geotrain.costs.compression import outer_wire_bytes
from geotrain.errors import GeotrainError
from geotrain.runtime.compress import decode_outer, encode_outer

POLL_S = 0.25           # how often a waiting member looks at the store (abort decided? a peer dead?)
Member = tuple[int, int]   # (worker, incarnation)
FINISHED = "geotrain/outer/finished"
EXPECT = "geotrain/outer/expect"        # workers the others wait for at their next exchange (elastic)


class WorkerDropped(GeotrainError):
    """The other workers went on without this one (it was found dead, or too slow to be alive)."""


class OuterGroup:
    """Rank `inner_rank` of worker `worker` among its counterparts in every worker.

    Membership: every member heartbeats in the outer store (a counter; a peer is dead when its
    counter stands still for `dead_after_s` of the observer's own clock -- no clocks compared
    across hosts). An attempt (exchange `seq`, try `a`) is decided once in the store by
    compare-and-set: "commit" once every member wrote its `done` key (after its receives arrived
    and its sends were acknowledged), or "abort" by a member that found another dead; the aborter
    writes the next attempt's members and all retry. A member removed raises `WorkerDropped`.
    Rejoin (`--elastic`): a restarted worker announces itself (`join`); the member committing an
    exchange of inner rank 0's group names the joiners in the verdict, which every group follows
    (`admit/<seq>`), so all of a joiner's ranks are admitted at one exchange, with the state the
    lowest surviving worker sends (runtime.diloco). With `rejoin_wait_s` the next commit waits that
    long for a dropped worker the launcher is restarting.
    No wait on the store is unbounded: a member waiting for a key watches the heartbeats of those
    who write it (an aborted attempt's survivors: its members; a rank's admission list: every
    worker's inner rank 0; a joiner's welcome: the other workers), so a lost peer is left behind or
    ends the wait in a one-line error -- never a hang, nor the store client's timeout as a traceback.

    `store` / `beat_store`: two clients of the outer store (the heartbeat thread has its own);
    `transport(ident)` builds this member's StripedTransport under the identity `ident`."""

    def __init__(self, store, beat_store, transport: Callable[[int], object], *, worker: int, workers: int,
                 inner_rank: int, inner_ranks: int, dead_after_s: float = 30.0, incarnation: int = 0,
                 members: list[Member] | None = None, rejoin_wait_s: float = 0.0):
        self.store, self.worker, self.workers = store, worker, workers
        self.inner_rank, self.inner_ranks, self.incarnation = inner_rank, inner_ranks, incarnation
        self.dead_after_s = dead_after_s
        self.rejoin_wait_s = rejoin_wait_s      # elastic: how long an exchange waits for a lost worker's restart
        self._expected: dict[int, float] = {}   # worker -> when this member started waiting for it
        self.key = f"geotrain/outer/r{inner_rank}"
        self.members: list[Member] = members or [(w, 0) for w in range(workers)]
        self.me: Member = (worker, incarnation)
        self.transport = transport(self.ident(self.me))
        self._seen: dict[str, tuple[int, float]] = {}   # heartbeat counter -> its value, since when (local clock)
        self._closed = threading.Event()
        self._beat_store = beat_store
        self._beat()
        threading.Thread(target=self._beats, name="outer-heartbeat", daemon=True).start()
        self.exchanges = 0
        self.sent_bytes = 0        # outer payloads this member put on its transport, all exchanges
        self.admitted: list[Member] = []     # joiners the last exchange admitted (they get the state)
        self.also_close: list = []           # closed with the group (the outer turns' arbiters and clients)

    def ident(self, m: Member) -> int:
        """The transport identity of member m: unique per worker, inner rank and incarnation."""
        w, inc = m
        return (inc * self.workers + w) * self.inner_ranks + self.inner_rank

    # -- heartbeats ------------------------------------------------------------------------
    def _hb(self, m: Member) -> str:
        return f"{self.key}/hb/{m[0]}/{m[1]}"

    def _beat(self) -> None:
        self._beat_store.add(self._hb(self.me), 1)
        self._beat_store.add(f"{self.key}/alive/{self.worker}", 1)     # any incarnation: a joiner watches it

    def _beats(self) -> None:
        while not self._closed.wait(self.dead_after_s / 6):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 -- the store gone at the end of a run: nothing to tell anyone
                return

    def _dead(self, m: Member) -> bool:
        """Whether m's heartbeat stood still for dead_after_s (10x that before its first beat)."""
        return self._still(self._hb(m))

    def _still(self, counter: str) -> bool:
        """Whether a heartbeat counter stood still for dead_after_s of our clock (10x before its first beat)."""
        value = int(self.store.add(counter, 0))
        now = time.monotonic()
        old = self._seen.get(counter)
        if old is None or old[0] != value:
            self._seen[counter] = (value, now)
            return False
        limit = self.dead_after_s if value > 0 else 10 * self.dead_after_s
        return now - old[1] > limit

    def _await(self, key: str, lost) -> str:
        """The value of `key` once written; meanwhile `lost()` (polled) may end the wait by raising."""
        while not self.store.check([key]):
            lost()
            time.sleep(POLL_S)
        raw = self.store.get(key)
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    # -- the exchange -------------------------------------------------------------------------
    def average(self, vec: torch.Tensor, codec: str) -> torch.Tensor:
        """The members' mean of `vec` (flat fp32, same length everywhere), identical on every member."""
        seq, a = self.exchanges, 0
        members = list(self.members)
        while True:
            if self.me not in members:
                raise WorkerDropped(f"worker {self.worker} was dropped from the outer exchange #{seq} (the others "
                                    "found it unresponsive and went on)")
            out = self._attempt(seq, a, members, vec, codec)
            if out is not None:
                self.admitted = self._admitted(seq, a, members)
                self.members, self.exchanges = members + self.admitted, seq + 1
                return out
            a += 1
            members = [tuple(m) for m in json.loads(self._survivors(seq, a, members))]

    def _survivors(self, seq: int, a: int, members: list[Member]) -> str:
        """Attempt a's members (JSON), named by whoever aborted attempt a - 1 -- or, if it died before
        naming them, by the first member to find someone of `members` dead (compare-and-set: one list)."""
        key = f"{self.key}/m/{seq}/{a}"

        def lost() -> None:
            dead = [m for m in members if m != self.me and self._dead(m)]
            if dead:
                self.store.compare_set(key, "", json.dumps([m for m in members if m not in dead]))

        return self._await(key, lost)

    def _attempt(self, seq: int, a: int, members: list[Member], vec: torch.Tensor, codec: str):
        k = len(members)
        pos = members.index(self.me)
        parts = list(torch.tensor_split(vec.float(), k))
        sizes = [p.numel() for p in parts]
        tag = (seq * 256 + a) * 2
        if k == 1:
            out = decode_outer(encode_outer(vec.float(), codec), vec.numel(), codec)
            return out if self._finish(seq, a, members) else None
        others = [(j, m) for j, m in enumerate(members) if j != pos]
        sends = [(m, self._send(encode_outer(parts[j], codec), m, tag)) for j, m in others]
        got = {j: torch.empty(outer_wire_bytes(sizes[pos], codec), dtype=torch.uint8) for j, _ in others}
        recvs = [(m, self.transport.recv(got[j], self.ident(m), tag)) for j, m in others]
        if not self._wait(recvs, seq, a, members):
            return None
        total = torch.zeros(sizes[pos])
        for j in range(k):
            total += parts[pos] if j == pos else decode_outer(got[j], sizes[pos], codec)
        payload = encode_outer(total / k, codec)
        mine = decode_outer(payload, sizes[pos], codec)
        sends += [(m, self._send(payload, m, tag + 1)) for _, m in others]
        back = {j: torch.empty(outer_wire_bytes(sizes[j], codec), dtype=torch.uint8) for j, _ in others}
        recvs = [(m, self.transport.recv(back[j], self.ident(m), tag + 1)) for j, m in others]
        if not self._wait(recvs + sends, seq, a, members):
            return None
        out = torch.cat([mine if j == pos else decode_outer(back[j], sizes[j], codec) for j in range(k)])
        return out if self._finish(seq, a, members) else None

    def _send(self, payload: torch.Tensor, m: Member, tag: int):
        self.sent_bytes += payload.numel()
        return self.transport.send(payload, self.ident(m), tag)

    def _wait(self, works, seq: int, a: int, members: list[Member]) -> bool:
        """Until every work completed (True), or the attempt was aborted (False)."""
        last = time.monotonic()
        while True:
            failed = [m for m, w in works if w.is_completed() and not _ok(w)]
            if failed:
                return self._abort(seq, a, members, failed)
            if all(w.is_completed() for _, w in works):
                return True
            time.sleep(0.002)
            if time.monotonic() - last > POLL_S:
                last = time.monotonic()
                if self._verdict(seq, a) == "abort":
                    return False
                waiting = {m for m, w in works if not w.is_completed()}
                dead = [m for m in waiting if self._dead(m)]
                if dead and not self._abort(seq, a, members, dead):
                    return False

    def _finish(self, seq: int, a: int, members: list[Member]) -> bool:
        """Write this member's `done`; once every member's is there, commit (True) -- unless a dead
        member made someone abort first (False)."""
        self.store.set(f"{self.key}/done/{seq}/{a}/{self.me[0]}/{self.me[1]}", "1")
        keys = [f"{self.key}/done/{seq}/{a}/{w}/{i}" for w, i in members]
        pause = 0.005
        while True:
            verdict = self._verdict(seq, a)
            if verdict:
                return verdict.startswith("commit")
            missing = [m for m, key in zip(members, keys, strict=True) if not self.store.check([key])]
            if not missing:
                return self._decide(seq, a, self._commit_value(members)).startswith("commit")
            dead = [m for m in missing if self._dead(m)]
            if dead and not self._abort(seq, a, members, dead):
                return False
            time.sleep(pause)
            pause = min(POLL_S / 2, pause * 1.5)      # few store requests while a slow worker finishes

    def _verdict(self, seq: int, a: int) -> str:
        key = f"{self.key}/fin/{seq}/{a}"
        if not self.store.check([key]):
            return ""
        raw = self.store.get(key)
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def _decide(self, seq: int, a: int, what: str) -> str:
        raw = self.store.compare_set(f"{self.key}/fin/{seq}/{a}", "", what)
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def _abort(self, seq: int, a: int, members: list[Member], dead: list[Member]) -> bool:
        """Try to abort the attempt without `dead`; False if aborted (by us or another), True if it
        was committed meanwhile (every member finished: keep waiting, the bytes are on their way)."""
        if self._decide(seq, a, "abort").startswith("commit"):
            return True
        survivors = [m for m in members if m not in dead]
        self.store.compare_set(f"{self.key}/m/{seq}/{a + 1}", "", json.dumps(survivors))
        if self.rejoin_wait_s:          # elastic: the launcher restarts them; hold an exchange for their return
            for w, _ in dead:
                self.store.set(f"{EXPECT}/{w}", "1")
        print(f"geotrain diloco: rank {self.inner_rank} of worker {self.worker}: outer exchange #{seq} goes on "
              f"without worker(s) {', '.join(str(w) for w, _ in dead)} (no heartbeat for {self.dead_after_s:g} s)",
              flush=True)
        return False

    # -- joining ---------------------------------------------------------------------------
    def _commit_value(self, members: list[Member]) -> str:
        """ "commit", naming (inner rank 0's group only) the workers waiting to rejoin."""
        if self.inner_rank != 0:
            return "commit"
        here = {w for w, _ in members}
        for w in range(self.workers):   # a worker being restarted: wait (up to rejoin_wait_s) for its announce
            if w in here or not self.store.check([f"{EXPECT}/{w}"]):
                continue
            since = self._expected.setdefault(w, time.monotonic())
            while not self.store.check([f"{self.key}/join/{w}"]) and time.monotonic() - since < self.rejoin_wait_s:
                time.sleep(POLL_S)
            if not self.store.check([f"{self.key}/join/{w}"]):
                self.store.delete_key(f"{EXPECT}/{w}")      # gave up waiting: go on without it
        joiners = [[w, int(self.store.get(f"{self.key}/join/{w}"))] for w in range(self.workers)
                   if w not in here and self.store.check([f"{self.key}/join/{w}"])]
        for w, _ in joiners:
            self.store.delete_key(f"{EXPECT}/{w}")
            self._expected.pop(w, None)
        return "commit:" + json.dumps(joiners) if joiners else "commit"

    def _admitted(self, seq: int, a: int, members: list[Member]) -> list[Member]:
        """The joiners exchange `seq` admits: inner rank 0's verdict, published for every rank's group."""
        admit = "geotrain/outer/admit"
        if self.inner_rank == 0:
            verdict = self._verdict(seq, a)
            joiners = verdict.split(":", 1)[1] if ":" in verdict else "[]"
            self.store.set(f"{admit}/{seq}", joiners)
        else:
            workers = sorted({w for w, _ in members})

            def lost() -> None:       # every worker's rank 0 writes the same list: one alive is enough
                if all([self._still(f"geotrain/outer/r0/alive/{w}") for w in workers]):
                    raise GeotrainError(f"DiLoCo worker {self.worker}: rank {self.inner_rank} waited for a rank 0 to "
                                        f"say whom outer exchange #{seq} admits, but the heartbeat of every "
                                        f"worker's rank 0 stopped {self.dead_after_s:g} s ago")
            joiners = self._await(f"{admit}/{seq}", lost)
        return [tuple(m) for m in json.loads(joiners) if tuple(m) not in members]

    def announce(self) -> None:
        """A restarted worker (incarnation > 0) asks to be admitted."""
        self.store.set(f"{self.key}/join/{self.worker}", str(self.incarnation))

    def welcome(self, to: Member, members: list[Member]) -> None:
        """Tell joiner `to` who sends it the state and who the members are now."""
        self.store.set(f"{self.key}/welcome/{to[0]}/{to[1]}", json.dumps({"from": self.me, "members": members,
                                                                         "exchanges": self.exchanges}))

    def welcomed(self) -> Member:
        """(Joiner) wait to be admitted; returns who sends the state; members and exchange count set."""
        others = [w for w in range(self.workers) if w != self.worker]

        def lost() -> None:
            if self.store.check([FINISHED]):
                raise GeotrainError(f"worker {self.worker} restarted too late: the other workers finished "
                                    "before an outer exchange could admit it")
            if all([self._still(f"{self.key}/alive/{w}") for w in others]):     # every one polled: no short cut
                raise GeotrainError(f"worker {self.worker} restarted, but no other worker is alive to admit it (no "
                                    f"heartbeat for {self.dead_after_s:g} s)")

        doc = json.loads(self._await(f"{self.key}/welcome/{self.worker}/{self.incarnation}", lost))
        self.members = [tuple(m) for m in doc["members"]]
        self.exchanges = int(doc["exchanges"])
        return tuple(doc["from"])

    def finished(self) -> None:
        """This member trained to the end (a worker still waiting to rejoin then gives up)."""
        self.store.set(FINISHED, "1")

    def close(self) -> None:
        self._closed.set()
        if hasattr(self.transport, "close"):
            self.transport.close()
        for x in self.also_close:
            x.close()


def _ok(work) -> bool:
    try:
        work.wait(timeout=0)
    except Exception:  # noqa: BLE001 -- a failed transfer: the peer is gone
        return False
    return True
