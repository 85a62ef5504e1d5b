"""Prefill-as-a-service: the state behind the OpenAI-compatible API (`bubbletea.openai_api`).

`PrefillService` owns admission (a bounded queue: 429 when full, 503 until a training rank has
joined or while shutting down), the prefill futures of the executor, decoding on the decode
worker, and the counters behind /metrics. Each accepted prompt is answered exactly once: it gets
one request id, one future that the executor resolves once, and one task that produces its
answer whatever happens to the client's connection.

The HTTP layer is FastAPI on uvicorn (`openai_api`, `http_server`); this module knows nothing of
HTTP beyond the status a `ServiceError` carries.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from geotrain.bubbletea.inference import Sampler
from geotrain.data.tokenizer import ByteTokenizer

MAX_BODY = 1 << 20


class ServiceError(Exception):
    """An answer in the OpenAI error shape: status, message, type, code, param."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, close: bool = False):
        super().__init__(message)
        self.status, self.kind, self.code, self.param, self.close = status, kind, code, param, close

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Stats:
    """Counters behind /metrics."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    t0: float = field(default_factory=time.monotonic)
    responses: dict[int, int] = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list)
    prefill_tokens: int = 0
    completion_tokens: int = 0
    in_flight: int = 0
    disconnects: int = 0

    def record(self, status: int) -> None:
        with self.lock:
            self.responses[status] = self.responses.get(status, 0) + 1


@dataclass
class Params:
    """What one completion asks for, validated (see openai_api.parse_completion)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False


class TextStream:
    """Turns generated token ids into text deltas, honouring EOS and stop strings: text that may
    still turn out to be part of a stop string (or an unfinished multi-byte character) is held
    back until it cannot, so streamed deltas never have to be taken back."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""
        self.finish_reason: str | None = None
        self.text = ""

    def push(self, token: int) -> str:
        if token == getattr(self.tok, "eos_id", None):
            self.finish_reason = "stop"
            return self.flush()
        self.ids.append(token)
        full = self.tok.decode(self.ids)
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.finish_reason = "stop"
            self.text = full[:cut]
            return self._delta(self.text)
        self.text = full
        safe = full[:len(full) - self.hold] if self.hold else full
        return self._delta(safe.rstrip("\ufffd"))

    def flush(self) -> str:
        return self._delta(self.text)

    def _delta(self, upto: str) -> str:
        if not upto.startswith(self.sent):      # a tokenizer re-spelled earlier text: wait for the end
            return ""
        out, self.sent = upto[len(self.sent):], upto
        return out


class PrefillService:
    """executor: `submit(id, tokens) -> Future[PrefillOutput]` (bubble or dedicated executor);
    decoder: `generate(out, n, sampler, last_prompt_token)` (executor.DecodeWorker);
    tokenizer: `encode(str) -> ids`, `decode(ids) -> str`, optional `eos_id` and `chat_template`
    (data.tokenizer); run_dir: a training run whose losses.jsonl /metrics reports."""

    def __init__(self, executor, decoder, *, max_queue: int = 32, max_prompt_tokens: int = 4096,
                 max_new_tokens: int = 64, vocab: int = 256, token: str | None = None,
                 request_timeout_s: float = 120.0, tokenizer=None, model_name: str = "geotrain-tiny",
                 run_dir: str | None = None, max_connections: int = 256, read_timeout_s: float = 10.0,
                 head_timeout_s: float = 3.0):
        self.executor, self.decoder = executor, decoder
        self.max_queue, self.max_prompt_tokens, self.max_new_limit = max_queue, max_prompt_tokens, max_new_tokens
        self.vocab, self.token, self.timeout = vocab, token, request_timeout_s
        self.tokenizer = tokenizer or ByteTokenizer()
        self.model_name, self.run_dir = model_name, run_dir
        self.max_connections, self.read_timeout_s, self.head_timeout_s = max_connections, read_timeout_s, head_timeout_s
        self.context = getattr(decoder, "context", max_prompt_tokens + max_new_tokens)
        self.stats = Stats()
        self.accepting = True
        self._ids = itertools.count()
        self._server = None
        self.created = int(time.time())

    # -- admission ---------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether an accepted request would be served: executors that depend on training ranks
        (BubbleExecutor) are not until a rank joins; queueing behind a cluster that is still
        starting would only turn into seconds of TTFT, so such requests get 503 + Retry-After."""
        ready = getattr(self.executor, "ready", None)
        return ready() if ready is not None else True

    def admit(self, n: int = 1) -> list[int]:
        """Reserve n places in the queue (one per prompt) or refuse them all."""
        with self.stats.lock:
            if not self.accepting:
                raise ServiceError(503, "shutting down, not accepting requests", kind="service_unavailable")
            if self.stats.in_flight + n > self.max_queue:
                raise ServiceError(429, "queue is full, retry later", kind="rate_limit_exceeded")
            if not self.ready():
                raise ServiceError(503, "no training rank has joined yet, retry shortly", kind="service_unavailable")
            self.stats.in_flight += n
            return [next(self._ids) for _ in range(n)]

    def release(self) -> None:
        with self.stats.lock:
            self.stats.in_flight -= 1

    def check_prompt(self, tokens: list[int], max_tokens: int) -> None:
        if not tokens:
            raise ServiceError(400, "the prompt is empty", param="prompt")
        if any(not 0 <= t < self.vocab for t in tokens):
            raise ServiceError(400, f"token ids must be in [0, {self.vocab})", param="prompt")
        if len(tokens) > self.max_prompt_tokens:
            raise ServiceError(400, f"the prompt has {len(tokens)} tokens; this model's limit is "
                               f"{self.max_prompt_tokens} (context {self.context})", param="prompt",
                               code="context_length_exceeded")

    # -- one prompt --------------------------------------------------------------------------
    async def first_token(self, rid: int, tokens: list[int]):
        """Prefill (wherever the executor runs it); returns (PrefillOutput, TTFT seconds)."""
        t0 = time.monotonic()
        fut = self.executor.submit(rid, tokens)
        try:
            out = await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout)
        except asyncio.TimeoutError:
            fut.cancel()
            raise ServiceError(504, "prefill did not finish in time", kind="timeout") from None
        except ServiceError:
            raise
        except Exception as e:  # noqa: BLE001 -- the request fails, the service goes on
            raise ServiceError(500, f"prefill failed: {e}", kind="server_error") from None
        ttft = time.monotonic() - t0
        with self.stats.lock:
            self.stats.ttfts.append(ttft)
            self.stats.prefill_tokens += len(tokens)
        return out, ttft

    def tokens_after(self, out, tokens: list[int], p: Params) -> Iterator[int]:
        """The completion's token ids (blocking: run on a worker thread)."""
        room = self.context - len(tokens)
        sampler = Sampler(p.temperature, p.top_p, p.seed)
        yield from self.decoder.generate(out, min(p.max_tokens, max(room, 0) + 1), sampler, tokens[-1])

    def count_completion(self, n: int) -> None:
        with self.stats.lock:
            self.stats.completion_tokens += n

    # -- lifecycle ---------------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int = 0, idle_priority: bool = False) -> tuple[str, int]:
        """Start the HTTP API on a background thread; returns the bound address. A port in use
        is a GeotrainError (one line)."""
        # lazy: the ASGI stack (fastapi, starlette, uvicorn, prometheus_client) only when serving
        from geotrain.bubbletea.http_server import HttpServer
        from geotrain.bubbletea.openai_api import build_app

        self._server = HttpServer(build_app(self), max_connections=self.max_connections,
                                  header_timeout_s=self.head_timeout_s)
        return self._server.start(host, port, idle_priority=idle_priority)

    def stop_accepting(self) -> None:
        with self.stats.lock:
            self.accepting = False

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Wait until every accepted request has been answered."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.stats.lock:
                if self.stats.in_flight == 0:
                    return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
