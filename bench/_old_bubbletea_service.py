"""The hand-written HTTP layer BubbleTea had before the OpenAI-compatible API (commit bcfd1c6),
kept verbatim only so bench_bubbletea_api.py can measure the new API against it.

Prefill-as-a-service: an HTTP API in front of a prefill executor and a decode worker.

  POST /v1/completions  {"prompt": "text"} or {"tokens": [ids]}, optional "max_new_tokens",
                        "stream" (NDJSON lines: first token, then one line per token, then done)
  GET  /metrics         Prometheus text: queue length, TTFT, prefill tokens/s, utilization gained
  GET  /healthz

Bound to 127.0.0.1 by default; optional bearer-token authentication. Malformed or oversized
requests get a 4xx; a full queue answers 429. Each accepted request is answered exactly once:
it owns one future, resolved once by the executor, and one handler thread writes its answer.
"""

from __future__ import annotations

import hmac
import itertools
import json
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 1 << 20


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512  # the default backlog of 5 resets connections under a burst


class ServiceError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Stats:
    """Counters behind /metrics."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.responses: dict[int, int] = {}
        self.ttfts: list[float] = []
        self.prefill_tokens = 0
        self.in_flight = 0

    def record(self, status: int) -> None:
        with self.lock:
            self.responses[status] = self.responses.get(status, 0) + 1


class PrefillService:
    def __init__(self, executor, decoder, *, max_queue: int = 32, max_prompt_tokens: int = 4096,
                 max_new_tokens: int = 64, vocab: int = 256, token: str | None = None,
                 request_timeout_s: float = 120.0):
        self.executor, self.decoder = executor, decoder
        self.max_queue, self.max_prompt_tokens, self.max_new_limit = max_queue, max_prompt_tokens, max_new_tokens
        self.vocab, self.token, self.timeout = vocab, token, request_timeout_s
        self.stats = Stats()
        self.accepting = True
        self._ids = itertools.count()
        self._server: ThreadingHTTPServer | None = None

    # -- request handling -----------------------------------------------------------------
    def parse(self, body: bytes) -> tuple[list[int], int, bool]:
        try:
            doc = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ServiceError(400, "body is not valid JSON") from None
        if not isinstance(doc, dict):
            raise ServiceError(400, "body must be a JSON object")
        unknown = set(doc) - {"prompt", "tokens", "max_new_tokens", "stream"}
        if unknown:
            raise ServiceError(400, f"unknown field(s): {', '.join(sorted(unknown))}")
        if ("prompt" in doc) == ("tokens" in doc):
            raise ServiceError(400, "give exactly one of 'prompt' (text) or 'tokens' (ids)")
        if "prompt" in doc:
            if not isinstance(doc["prompt"], str) or not doc["prompt"]:
                raise ServiceError(400, "'prompt' must be a non-empty string")
            tokens = list(doc["prompt"].encode("utf-8"))  # byte-level tokenizer
        else:
            t = doc["tokens"]
            if not isinstance(t, list) or not t or not all(isinstance(x, int) and not isinstance(x, bool)
                                                           for x in t):
                raise ServiceError(400, "'tokens' must be a non-empty list of integers")
            if any(x < 0 or x >= self.vocab for x in t):
                raise ServiceError(400, f"token ids must be in [0, {self.vocab})")
            tokens = t
        if len(tokens) > self.max_prompt_tokens:
            raise ServiceError(413, f"prompt of {len(tokens)} tokens exceeds the limit of {self.max_prompt_tokens}")
        n = doc.get("max_new_tokens", min(16, self.max_new_limit))
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= self.max_new_limit:
            raise ServiceError(400, f"'max_new_tokens' must be an integer in [0, {self.max_new_limit}]")
        stream = doc.get("stream", False)
        if not isinstance(stream, bool):
            raise ServiceError(400, "'stream' must be true or false")
        return tokens, n, stream

    def admit(self) -> int:
        with self.stats.lock:
            if not self.accepting:
                raise ServiceError(503, "shutting down, not accepting requests")
            if self.stats.in_flight >= self.max_queue:
                raise ServiceError(429, "queue is full, retry later")
            if not self.ready():
                raise ServiceError(503, "no training rank has joined yet, retry shortly")
            self.stats.in_flight += 1
        return next(self._ids)

    def ready(self) -> bool:
        """Whether an accepted request would be served: executors that depend on training ranks
        (BubbleExecutor) are not until a rank joins; queueing behind a cluster that is still
        starting would only turn into seconds of TTFT, so such requests get 503 + Retry-After."""
        ready = getattr(self.executor, "ready", None)
        return ready() if ready is not None else True

    def release(self) -> None:
        with self.stats.lock:
            self.stats.in_flight -= 1

    def metrics_text(self) -> str:
        s = self.stats
        with s.lock:
            ttfts = sorted(s.ttfts)
            up = max(1e-9, time.monotonic() - s.t0)
            lines = [
                "# HELP geotrain_bubbletea_queue_length Accepted requests not yet answered.",
                "# TYPE geotrain_bubbletea_queue_length gauge",
                f"geotrain_bubbletea_queue_length {s.in_flight}",
                "# HELP geotrain_bubbletea_responses_total Responses by HTTP status.",
                "# TYPE geotrain_bubbletea_responses_total counter",
            ]
            lines += [f'geotrain_bubbletea_responses_total{{code="{c}"}} {n}' for c, n in sorted(s.responses.items())]
            lines += [
                "# HELP geotrain_bubbletea_ttft_seconds Time to first token.",
                "# TYPE geotrain_bubbletea_ttft_seconds summary",
            ]
            for q in (0.5, 0.99):
                v = ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else 0.0
                lines.append(f'geotrain_bubbletea_ttft_seconds{{quantile="{q}"}} {v:.6f}')
            lines += [
                f"geotrain_bubbletea_ttft_seconds_sum {sum(ttfts):.6f}",
                f"geotrain_bubbletea_ttft_seconds_count {len(ttfts)}",
                "# HELP geotrain_bubbletea_prefill_tokens_total Prompt tokens prefilled.",
                "# TYPE geotrain_bubbletea_prefill_tokens_total counter",
                f"geotrain_bubbletea_prefill_tokens_total {s.prefill_tokens}",
                "# HELP geotrain_bubbletea_prefill_tokens_per_second Mean prefill tokens/s since start.",
                "# TYPE geotrain_bubbletea_prefill_tokens_per_second gauge",
                f"geotrain_bubbletea_prefill_tokens_per_second {s.prefill_tokens / up:.3f}",
                "# HELP geotrain_bubbletea_utilization_gained Fraction of GPU time used by prefill.",
                "# TYPE geotrain_bubbletea_utilization_gained gauge",
                f"geotrain_bubbletea_utilization_gained {self.executor.utilization_gained():.6f}",
            ]
        return "\n".join(lines) + "\n"

    # -- server -----------------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int = 0, idle_priority: bool = False) -> tuple[str, int]:
        """Start serving on a background thread; returns the bound address.

        idle_priority: the HTTP threads, and the decoding they run, take only CPU that nothing
        else wants (handler threads inherit the server thread's priority) -- for a service that
        shares cores with training ranks. Safe because ranks never wait for the service past
        their bubble (see bubble_executor), so a starved service costs prefill, not training."""
        from geotrain.bubbletea.idle_priority import lower_own_priority

        self._server = server = _Server((host, port), _make_handler(self))

        def run() -> None:
            if idle_priority:
                lower_own_priority()
            server.serve_forever()

        threading.Thread(target=run, name="bubbletea-http", daemon=True).start()
        return server.server_address[:2]

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
        if self._server:
            self._server.shutdown()
            self._server.server_close()


def _make_handler(svc: PrefillService):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "geotrain-bubbletea"

        def log_message(self, *args: object) -> None:  # quiet: metrics tell the story
            pass

        def _send(self, status: int, body: dict | str, ctype: str = "application/json") -> None:
            data = (json.dumps(body) if isinstance(body, dict) else body).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            if status in (429, 503):
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(data)
            svc.stats.record(status)

        def _authorized(self) -> bool:
            if svc.token is None:
                return True
            got = self.headers.get("Authorization", "")
            return hmac.compare_digest(got.encode(), f"Bearer {svc.token}".encode())

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._send(200, {"status": "ok", "ready": svc.ready()})
            elif self.path == "/metrics":
                if not self._authorized():
                    return self._send(401, {"error": "missing or wrong bearer token"})
                self._send(200, svc.metrics_text(), "text/plain; version=0.0.4")
            else:
                self._send(404, {"error": f"no such path {self.path}"})

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                return self._send(404, {"error": f"no such path {self.path}"})
            if not self._authorized():
                return self._send(401, {"error": "missing or wrong bearer token"})
            try:
                length = int(self.headers.get("Content-Length", "-1"))
            except ValueError:
                length = -1
            if length < 0:
                self.close_connection = True
                return self._send(411, {"error": "Content-Length required"})
            if length > MAX_BODY:
                self.close_connection = True
                return self._send(413, {"error": f"body over {MAX_BODY} bytes"})
            body = self.rfile.read(length)
            try:
                tokens, max_new, stream = svc.parse(body)
                rid = svc.admit()
            except ServiceError as e:
                return self._send(e.status, {"error": str(e)})
            try:
                self._complete(rid, tokens, max_new, stream)
            finally:
                svc.release()

        def _complete(self, rid: int, tokens: list[int], max_new: int, stream: bool) -> None:
            t0 = time.monotonic()
            fut = svc.executor.submit(rid, tokens)
            try:
                out = fut.result(timeout=svc.timeout)
            except FutureTimeout:
                fut.cancel()
                return self._send(504, {"id": rid, "error": "prefill did not finish in time"})
            except Exception as e:
                return self._send(500, {"id": rid, "error": f"prefill failed: {e}"})
            ttft = time.monotonic() - t0
            with svc.stats.lock:
                svc.stats.ttfts.append(ttft)
                svc.stats.prefill_tokens += len(tokens)
            head = {"id": rid, "first_token": out.first_token, "ttft_ms": round(ttft * 1e3, 3),
                    "prompt_tokens": len(tokens), "prefill_on": out.where}
            if not stream:
                rest = list(svc.decoder.generate(out, max_new - 1)) if max_new > 0 else []
                toks = [out.first_token] + rest if max_new > 0 else [out.first_token]
                return self._send(200, {**head, "tokens": toks,
                                        "text": bytes(t for t in toks if t < 256).decode("utf-8", "replace")})
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def chunk(d: dict) -> None:
                data = (json.dumps(d) + "\n").encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            chunk(head)
            n = 1
            if max_new > 1:
                for tok in svc.decoder.generate(out, max_new - 1):
                    chunk({"token": tok})
                    n += 1
            chunk({"done": True, "tokens": n})
            self.wfile.write(b"0\r\n\r\n")
            svc.stats.record(200)

    return Handler
