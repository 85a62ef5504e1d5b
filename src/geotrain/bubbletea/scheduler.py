"""Placing prefill requests into predicted bubbles without delaying training.

Each request goes, whole or in chunks, to the rank and bubbles where it finishes earliest.
A chunk must end `margin` seconds before its bubble does: if the next piece of the prompt
does not fit, it waits for the next bubble instead of overrunning into training work. All
chunks of a request stay on one rank, where its KV cache grows.

Ranks are kept in a heap by the time their bubble capacity is next free, and only the
`candidates` earliest are tried per request: with thousands of GPUs the best rank is almost
always among them, and placement stays O(log R) per request.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass

from geotrain.bubbletea.bubbles import Window
from geotrain.bubbletea.prefill_cost import PrefillCost


@dataclass(frozen=True)
class Request:
    id: int
    arrival: float
    prompt_len: int


@dataclass(frozen=True)
class Chunk:
    request_id: int
    rank: int
    start: float
    end: float
    tokens: int
    context: int     # tokens already in the KV cache before this chunk


@dataclass(frozen=True)
class Placement:
    request: Request
    rank: int
    chunks: tuple[Chunk, ...]

    @property
    def finish(self) -> float:
        return self.chunks[-1].end

    @property
    def ttft(self) -> float:
        return self.finish - self.request.arrival


class BubbleScheduler:
    def __init__(self, windows: dict[int, list[Window]], period: float, cost: PrefillCost,
                 margin: float = 0.0, min_chunk: int = 16, candidates: int = 8, max_wait: float = math.inf):
        if period <= 0:
            raise ValueError("period must be positive")
        self.period, self.cost, self.margin = period, cost, margin
        self.min_chunk, self.candidates, self.max_wait = min_chunk, candidates, max_wait
        # Only windows long enough for a minimal chunk are worth visiting.
        usable = cost.chunk_time(min_chunk) + margin
        self.windows = {r: sorted((w for w in ws if w.length >= usable), key=lambda w: w.offset)
                        for r, ws in windows.items()}
        self.windows = {r: ws for r, ws in self.windows.items() if ws}
        # Per rank: window starts and usable ends (end - margin) within a period, for bisection.
        self._starts = {r: [w.offset for w in ws] for r, ws in self.windows.items()}
        self._ends = {r: [w.end - margin for w in ws] for r, ws in self.windows.items()}
        self.free_at = {r: 0.0 for r in self.windows}
        self._heap = [(self._next_start(r, 0.0), r) for r in self.windows]
        heapq.heapify(self._heap)

    def _iter_windows(self, rank: int, t: float) -> Iterator[tuple[float, float]]:
        """Absolute (start, usable end) of the rank's windows that end after t, in time order."""
        starts, ends, T = self._starts[rank], self._ends[rank], self.period
        k = max(0, int(t // T))
        i = bisect.bisect_right(ends, t - k * T)
        while True:
            base = k * T
            for j in range(i, len(ends)):
                yield max(base + starts[j], t), base + ends[j]
            k, i = k + 1, 0

    def _next_start(self, rank: int, t: float) -> float:
        return next(self._iter_windows(rank, t))[0]

    def _try(self, rank: int, req: Request) -> tuple[Chunk, ...] | None:
        t = max(req.arrival, self.free_at[rank])
        left, ctx, chunks = req.prompt_len, 0, []
        progress_at = t
        for start, end in self._iter_windows(rank, t):
            if start - req.arrival > self.max_wait or start - progress_at > self.period:
                return None  # waited too long, or no bubble of this rank can take the next piece
            budget = end - start
            whole = self.cost.chunk_time(left, ctx)
            if whole <= budget:
                chunks.append(Chunk(req.id, rank, start, start + whole, left, ctx))
                return tuple(chunks)
            n = self.cost.max_chunk(budget, ctx)
            if n >= self.min_chunk:
                n = min(n, left)
                dur = self.cost.chunk_time(n, ctx)
                chunks.append(Chunk(req.id, rank, start, start + dur, n, ctx))
                left, ctx, progress_at = left - n, ctx + n, start
        return None

    def place(self, req: Request) -> Placement | None:
        """Place one request (requests must come in arrival order). None: no bubble can
        take it within max_wait (the caller refuses or queues it elsewhere)."""
        if not self._heap:
            return None
        tried = [heapq.heappop(self._heap) for _ in range(min(self.candidates, len(self._heap)))]
        best: tuple[Chunk, ...] | None = None
        for _, rank in tried:
            chunks = self._try(rank, req)
            if chunks and (best is None or chunks[-1].end < best[-1].end):
                best = chunks
        if best is not None:
            self.free_at[best[0].rank] = best[-1].end
        for _, rank in tried:
            heapq.heappush(self._heap, (self._next_start(rank, self.free_at[rank]), rank))
        return None if best is None else Placement(req, best[0].rank, best)
