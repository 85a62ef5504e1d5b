"""The OpenAI-compatible HTTP API of BubbleTea (the vLLM convention), on FastAPI.

  GET  /v1/models            the one served model
  POST /v1/completions       model, prompt (string, strings, token ids), max_tokens, temperature,
                             top_p, seed, stop, stream (server-sent events ending `data: [DONE]`)
  POST /v1/chat/completions  when the tokenizer has a chat template
  GET  /metrics              Prometheus text (bubbletea.prometheus)
  GET  /healthz              {"status": "ok", "ready": a training rank has joined}

Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}. Bodies are read
here, bounded in size and time, and parsed with the standard json module; anything malformed
(invalid UTF-8 or lone surrogates, nesting too deep, numbers too long) is a 400, never a
traceback. Each choice also carries geotrain's own fields: token_ids, prefill_on, ttft_ms.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from geotrain.bubbletea.prometheus import CONTENT_TYPE, metrics_text
from geotrain.bubbletea.service import MAX_BODY, Params, ServiceError, TextStream

log = logging.getLogger("geotrain.bubbletea")

_COMPLETION_KEYS = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "n",
                    "user", "stream_options", "echo", "logprobs", "presence_penalty", "frequency_penalty",
                    "best_of", "suffix", "logit_bias"}
_CHAT_KEYS = (_COMPLETION_KEYS - {"prompt", "echo", "best_of", "suffix", "logprobs"}) | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs"}
_NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False}


class _CountStatus:
    """Pure ASGI middleware: counts responses by status for /metrics (streams included), except
    those of /healthz and /metrics themselves, which pollers call all the time."""

    def __init__(self, app, stats):
        self.app, self.stats = app, stats

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in ("/healthz", "/metrics"):
            return await self.app(scope, receive, send)

        async def counting(msg):
            if msg["type"] == "http.response.start":
                self.stats.record(msg["status"])
            await send(msg)

        await self.app(scope, receive, counting)


def _error(e: ServiceError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else {}
    if e.close:
        headers["Connection"] = "close"
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def read_json(request: Request, svc) -> dict:
    """The body as a JSON object; bounded in size (413) and in time (408), malformed -> 400."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or len(length) > 12 or int(length) > MAX_BODY):
        raise ServiceError(413, f"the body must be at most {MAX_BODY} bytes", close=True)

    async def collect() -> bytes:
        chunks, size = [], 0
        async for c in request.stream():
            size += len(c)
            if size > MAX_BODY:
                raise ServiceError(413, f"the body must be at most {MAX_BODY} bytes", close=True)
            chunks.append(c)
        return b"".join(chunks)

    try:
        body = await asyncio.wait_for(collect(), svc.read_timeout_s)
    except asyncio.TimeoutError:
        raise ServiceError(408, f"the body did not arrive within {svc.read_timeout_s:.0f} s", close=True) from None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:      # bad UTF-8, bad JSON, too deep, digits past Python's limit
        raise ServiceError(400, f"the body is not valid JSON ({str(e)[:80]})") from None
    if not isinstance(doc, dict):
        raise ServiceError(400, "the body must be a JSON object")
    return doc


def _number(doc: dict, key: str, lo: float, hi: float, default, integer: bool = False):
    v = doc.get(key)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise ServiceError(400, f"'{key}' must be {kind} in [{lo:g}, {hi:g}]", param=key)
    return v


def _params(doc: dict, svc, keys: set[str], max_key: str = "max_tokens") -> Params:
    unknown = sorted(set(doc) - keys)
    if unknown:
        raise ServiceError(400, f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    if "model" in doc and doc["model"] != svc.model_name:
        raise ServiceError(404, f"the model {doc['model']!r} does not exist; this server serves "
                           f"{svc.model_name!r}", param="model", code="model_not_found")
    for k, neutral in _NEUTRAL.items():
        if doc.get(k) not in (None, neutral):
            raise ServiceError(400, f"'{k}' other than {json.dumps(neutral)} is not supported", param=k)
    stop = doc.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or not all(isinstance(s, str) and s for s in stop)):
        raise ServiceError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise ServiceError(400, "'stream' must be true or false", param="stream")
    n = doc.get(max_key, doc.get("max_tokens"))
    max_tokens = _number({"max_tokens": n}, "max_tokens", 1, svc.max_new_limit,
                         min(16, svc.max_new_limit), integer=True)
    return Params(max_tokens=max_tokens, temperature=float(_number(doc, "temperature", 0, 2, 1.0)),
                  top_p=float(_number(doc, "top_p", 0.0, 1.0, 1.0)) or 1.0,
                  seed=_number(doc, "seed", -(2**63), 2**63 - 1, None, integer=True), stop=stop or [], stream=stream)


def _encode(svc, text: str, param: str = "prompt") -> list[int]:
    try:
        return list(svc.tokenizer.encode(text))
    except (UnicodeError, ValueError):
        raise ServiceError(400, f"'{param}' is not valid Unicode text (lone surrogate?)", param=param) from None


def _prompts(doc: dict, svc) -> list[list[int]]:
    p = doc.get("prompt")
    if isinstance(p, str):
        return [_encode(svc, p)]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return [_encode(svc, x) for x in p]
    if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                    for t in x) for x in p):
        return p
    raise ServiceError(400, "'prompt' must be a string, a list of strings, or token ids", param="prompt")


def _chat_prompt(doc: dict, svc) -> list[int]:
    render = getattr(svc.tokenizer, "apply_chat_template", None)
    if render is None or not getattr(svc.tokenizer, "chat_template", None):
        raise ServiceError(400, f"{svc.model_name}'s tokenizer has no chat template: use /v1/completions")
    msgs = doc.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
        raise ServiceError(400, "'messages' must be a list of {role, content} strings", param="messages")
    try:
        text = render(msgs)
    except Exception as e:  # noqa: BLE001 -- a template error is the request's problem, one line
        raise ServiceError(400, f"the chat template failed on these messages ({str(e)[:100]})") from None
    return _encode(svc, text, "messages")


async def _produce(svc, rid: int, tokens: list[int], p: Params, index: int, q: asyncio.Queue, gone: asyncio.Event):
    """One prompt's whole answer into `q`; runs to the end (and releases its queue place)
    whether or not the client is still there."""
    gen = None
    try:
        out, ttft = await svc.first_token(rid, tokens)
        await q.put((index, "start", {"ttft_ms": round(ttft * 1e3, 3), "prefill_on": out.where}))
        ts, n = TextStream(svc.tokenizer, p.stop), 0
        gen = svc.tokens_after(out, tokens, p)
        while not gone.is_set():
            tok = await run_in_threadpool(next, gen, None)
            if tok is None:
                break
            n += 1
            delta = ts.push(tok)
            if delta:
                await q.put((index, "text", delta))
            if ts.finish_reason:
                break
        tail = ts.flush()
        if tail:
            await q.put((index, "text", tail))
        svc.count_completion(n)
        await q.put((index, "end", {"finish_reason": ts.finish_reason or "length", "token_ids": ts.ids,
                                    "prompt_tokens": len(tokens), "completion_tokens": n}))
    except ServiceError as e:
        await q.put((index, "error", e))
    except Exception as e:  # noqa: BLE001 -- one request fails, the service goes on
        log.warning("bubbletea: request %d failed: %s", rid, e)
        await q.put((index, "error", ServiceError(500, f"generation failed: {e}", kind="server_error")))
    finally:
        if gen is not None:
            gen.close()
        svc.release()


async def _answer(svc, request: Request, prompts: list[list[int]], p: Params, chat: bool):
    for t in prompts:
        svc.check_prompt(t, p.max_tokens)
    rids = svc.admit(len(prompts))
    q: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    for i, (rid, t) in enumerate(zip(rids, prompts)):
        asyncio.get_running_loop().create_task(_produce(svc, rid, t, p, i, q, gone))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{rids[0]}"
    created, obj = int(time.time()), "chat.completion" if chat else "text_completion"
    first = await q.get()
    if first[1] == "error":
        gone.set()
        raise first[2]
    if p.stream:
        return StreamingResponse(_sse(svc, first, q, len(prompts), rid, created, chat, gone, request),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    choices = [{"index": i, "text": "", "ttft_ms": None, "prefill_on": None} for i in range(len(prompts))]
    ended, usage = 0, {"prompt_tokens": 0, "completion_tokens": 0}
    item = first
    while True:
        i, kind, data = item
        if kind == "error":
            gone.set()
            raise data
        if kind == "start":
            choices[i].update(data)
        elif kind == "text":
            choices[i]["text"] += data
        else:
            choices[i].update(finish_reason=data["finish_reason"], token_ids=data["token_ids"], logprobs=None)
            usage["prompt_tokens"] += data["prompt_tokens"]
            usage["completion_tokens"] += data["completion_tokens"]
            ended += 1
            if ended == len(prompts):
                break
        item = await q.get()
    if chat:
        for c in choices:
            c["message"] = {"role": "assistant", "content": c.pop("text")}
    if await request.is_disconnected():
        _gone(svc, rid)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": svc.model_name,
                         "choices": choices, "usage": usage})


def _gone(svc, rid: str) -> None:
    with svc.stats.lock:
        svc.stats.disconnects += 1
    log.warning("bubbletea: client of %s disconnected before its answer ended", rid)


async def _sse(svc, first, q, n_prompts, rid, created, chat, gone, request):
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(i: int, text: str | None, finish: str | None, extra: dict | None = None) -> bytes:
        if chat:
            delta = {} if text is None else {"content": text}
            if extra is not None:
                delta["role"] = "assistant"
            choice = {"index": i, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
        choice.update(extra or {})
        doc = {"id": rid, "object": obj, "created": created, "model": svc.model_name, "choices": [choice]}
        return f"data: {json.dumps(doc)}\n\n".encode()

    ended, item = 0, first
    try:
        while True:
            i, kind, data = item
            if kind == "start":
                yield event(i, None if chat else "", None, data)
            elif kind == "text":
                yield event(i, data, None)
            elif kind == "error":
                yield f"data: {json.dumps(data.body())}\n\n".encode()
                ended += 1
            else:
                yield event(i, None if chat else "", data["finish_reason"], {"token_ids": data["token_ids"]})
                ended += 1
            if ended == n_prompts:
                break
            item = await q.get()
        yield b"data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        gone.set()
        _gone(svc, rid)
        raise


def build_app(svc) -> FastAPI:
    app = FastAPI(title="geotrain BubbleTea", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_CountStatus, stats=svc.stats)

    def authorize(request: Request) -> None:
        if svc.token is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode("utf-8", "replace"), f"Bearer {svc.token}".encode()):
            raise ServiceError(401, "missing or wrong bearer token", kind="invalid_request_error",
                               code="invalid_api_key")

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, e: ServiceError):
        return _error(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return _error(ServiceError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        if not isinstance(e, ClientDisconnect):      # (a client gone is said once, by http_server's guard)
            log.warning("bubbletea: %s %s failed: %s", request.method, request.url.path, e)
        return _error(ServiceError(500, "internal error", kind="server_error"))

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "ready": svc.ready()}

    @app.get("/metrics")
    async def metrics(request: Request):
        authorize(request)
        return Response(metrics_text(svc), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": svc.model_name, "object": "model", "created": svc.created,
                                            "owned_by": "geotrain", "max_model_len": svc.context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        doc = await read_json(request, svc)
        p = _params(doc, svc, _COMPLETION_KEYS)
        return await _answer(svc, request, _prompts(doc, svc), p, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        authorize(request)
        doc = await read_json(request, svc)
        p = _params(doc, svc, _CHAT_KEYS, max_key="max_completion_tokens")
        return await _answer(svc, request, [_chat_prompt(doc, svc)], p, chat=True)

    return app
