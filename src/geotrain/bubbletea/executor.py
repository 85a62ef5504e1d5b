"""Where prefill runs: the executor interface, a dedicated-thread executor, and the decode worker.

The service only needs `submit(request_id, tokens) -> Future[PrefillOutput]`. The dedicated
executor runs prefill on a thread of its own (a standalone service, and the baseline); the
bubble executor (bubbletea.bubble_executor) hands the same work to training ranks, which run
it only inside their bubbles. Either way the KV cache is handed to the `DecodeWorker` as raw
bytes, as it would cross the network to a separate decode machine.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from geotrain.bubbletea.inference import KVCache, Sampler, decode, greedy, last_logits, prefill
from geotrain.models.llama import UnitStack


@dataclass
class PrefillOutput:
    first_token: int
    kv_bytes: bytes
    kv_shape: list[int]
    kv_dtype: str
    prefill_s: float          # compute time spent on the prefill
    where: str = "dedicated"  # "dedicated" or "rank N"


class DedicatedExecutor:
    """Prefill on one worker thread, FIFO."""

    def __init__(self, model: UnitStack):
        self.model = model
        self._q: queue.Queue[tuple[Future, list[int]] | None] = queue.Queue()
        self.busy_s = 0.0
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="prefill", daemon=True)
        self._thread.start()

    def submit(self, request_id: int, tokens: list[int]) -> Future:
        fut: Future = Future()
        self._q.put((fut, tokens))
        return fut

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            fut, tokens = item
            if not fut.set_running_or_notify_cancel():
                continue
            t = time.perf_counter()
            try:
                first, cache = prefill(self.model, tokens)
                data, shape, dtype = cache.to_bytes()
                dt = time.perf_counter() - t
                self.busy_s += dt
                fut.set_result(PrefillOutput(first, data, shape, dtype, dt))
            except Exception as e:  # the request fails, the executor keeps serving
                fut.set_exception(e)

    def utilization_gained(self) -> float:
        return self.busy_s / max(1e-9, time.monotonic() - self._t0)

    def close(self) -> None:
        self._q.put(None)


class DecodeWorker:
    """Receives (first token, KV cache bytes) and generates the completion."""

    def __init__(self, model: UnitStack):
        self.model = model
        self._lock = threading.Lock()  # one decode at a time on this (CPU) worker

    @property
    def context(self) -> int:
        return self.model.spec.seq_len

    def generate(self, out: PrefillOutput, max_new_tokens: int, sampler: Sampler | None = None,
                 last_prompt_token: int | None = None) -> Iterator[int]:
        """The completion's tokens, the first one included, at most `max_new_tokens`. Greedy
        keeps the prefill's own first token; a sampler draws it again from the prefill's last
        logits (recomputed from the cache, see inference.last_logits)."""
        if max_new_tokens <= 0:
            return
        cache = KVCache.from_bytes(out.kv_bytes, out.kv_shape, out.kv_dtype)
        first = out.first_token
        if sampler is not None and sampler.temperature > 0 and last_prompt_token is not None:
            with self._lock:
                first = sampler(last_logits(self.model, cache, last_prompt_token))
        yield first
        steps = decode(self.model, first, cache, max_new_tokens - 1, pick=sampler or greedy)
        while True:  # lock per step, so a slow reader does not stall other streams
            with self._lock:
                tok = next(steps, None)
            if tok is None:
                return
            yield tok
