"""uvicorn on a background thread, with the limits a long-running service needs.

* the listening socket is bound here first, so a port in use is one line (GeotrainError), not a
  traceback from inside the server thread;
* at most `max_connections` connections and requests at once (uvicorn answers 503 beyond);
* at most `per_client` connections of one source address (default a quarter of max_connections;
  past it that address's new ones are closed at once), so one client opening connections and
  dripping their heads cannot hold every slot while others get 503 (slowloris);
* a connection must deliver a complete request head within `header_timeout_s` of opening (or of
  its previous answer; a few seconds: a head is one packet): uvicorn's own keep-alive timer is
  reset by every byte, so a client dripping a header a byte at a time would hold its connection forever;
* request framing is strict (`_FramingGuard`): a request with both Content-Length and
  Transfer-Encoding -- the two framings a proxy and this server may read differently, so a second
  request smuggled behind the first's body would be served -- is answered 400 and its connection
  closed (h11 closes after its own framing errors: bad chunks, two lengths);
* a client gone mid-request (ClientDisconnect) or any other failure escaping the app is one log
  line, never uvicorn's ASGI traceback;
* descriptors: at most `hard_cap` connections held open (past `max_connections` uvicorn answers
  503; past the hard cap, at most half the descriptor limit, a connection is closed at once), so a
  flood on the public port cannot take the descriptors the launcher needs for its own files
  (issue #30: 400 idle openers under `ulimit -n 200` left the launcher unable to open a file);
  and a process out of descriptors anyway is one line per 10 s that accepting goes on -- asyncio
  logged a traceback per queued connection and scheduled a retry for each (10,084 tracebacks in
  8 s), so the loop runs with its own exception handler and accepts one connection per wake-up;
* each kind of dropped or refused client is one log line per 10 s at most, with the count of those
  unsaid (the CLI sets logging up: `console.configure_logging`); uvicorn's own logging is left to
  the process's (no access log).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import socket
import threading
import time

import uvicorn
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from geotrain.bubbletea.idle_priority import lower_own_priority
from geotrain.errors import GeotrainError

log = logging.getLogger("geotrain.bubbletea")


class _Said:
    """One log line per `period_s` for a repeated event, saying how many went unsaid since the
    previous one (a flood must not flood the console)."""

    def __init__(self, period_s: float = 10.0, level: int = logging.WARNING):
        self.period_s, self.level, self.last, self.unsaid = period_s, level, -period_s, 0

    def __call__(self, line: str) -> None:
        if time.monotonic() - self.last < self.period_s:
            self.unsaid += 1
            return
        self.last = time.monotonic()
        more = f" ({self.unsaid} more like it since the previous such line)" if self.unsaid else ""
        self.unsaid = 0
        log.log(self.level, line + more)


class _UvicornLines:
    """uvicorn's protocol logger, its per-request warnings rate-limited (`Exceeded concurrency limit.`
    came once per 503: a flood's worth of lines); its bare `Invalid HTTP request received.` is left
    out (`send_400_response` says it with the peer's address). Anything else goes through as is."""

    UNSAID = "Invalid HTTP request received."

    def __init__(self, logger: logging.Logger, said: dict):
        self._logger, self._said = logger, said

    def warning(self, msg, *args, **_kwargs) -> None:
        if msg != self.UNSAID:
            self._said.setdefault(msg, _Said())(f"bubbletea: {msg % args if args else msg}")

    def __getattr__(self, name):
        return getattr(self._logger, name)


def _said_per_server() -> dict:
    """The protocol class's counters and rate-limited lines: one set per server."""
    return {"by_client": {}, "said": _Said(), "said_per_client": _Said(), "said_head": _Said(level=logging.INFO),
            "said_bad": _Said(level=logging.INFO), "said_uvicorn": {}}


class _HeadTimeoutH11(H11Protocol):
    """H11Protocol that closes a connection whose request head is not complete in time, and at once
    any connection past `hard_cap` open ones or past `per_client` of its source address."""

    head_timeout_s = 3.0
    hard_cap = 512
    per_client = 64
    by_client: dict[str, int] = {}          # open connections per source address (a dict per server)
    said = said_per_client = said_head = said_bad = _Said()
    said_uvicorn: dict[str, _Said] = {}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.logger = _UvicornLines(self.logger, self.said_uvicorn)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer, self._source = None, None
        source = self.client[0] if self.client else "?"
        if len(self.connections) > self.hard_cap:
            self.said(f"bubbletea: {self.hard_cap} connections are open already; closing new ones at once")
            transport.close()
            return
        if self.by_client.get(source, 0) >= self.per_client:
            self.said_per_client(f"bubbletea: {source} holds {self.per_client} connections already; "
                                 "closing its new ones at once")
            transport.close()
            return
        self._source = source
        self.by_client[source] = self.by_client.get(source, 0) + 1
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._served = True
        self._arm()

    def connection_lost(self, exc) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
        source = getattr(self, "_source", None)
        if source is not None:
            self._source = None
            left = self.by_client.get(source, 1) - 1
            if left:
                self.by_client[source] = left
            else:
                self.by_client.pop(source, None)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """h11 could not parse the request (uvicorn's warning does not say whose it was)."""
        self.said_bad(f"bubbletea: dropped a malformed request from {_peer(self.client)} ({msg.rstrip('.')})")
        super().send_400_response(msg)

    def _arm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._expire)

    def _expire(self) -> None:
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_head and not self.transport.is_closing():
            if not (getattr(self, "_served", False) and not self.conn.trailing_data[0]):   # not a keep-alive's end
                self.said_head(f"bubbletea: closed a connection from {_peer(self.client)} that sent no complete "
                               f"request in {self.head_timeout_s:g} s")
            self.transport.close()


class _FramingGuard:
    """The outermost ASGI layer (see the module docstring): CL+TE refused, escaping errors one line."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            names = [k.lower() for k, _ in scope.get("headers", ())]
            if b"transfer-encoding" in names and b"content-length" in names:
                log.info("bubbletea: refused a request from %s with both Content-Length and Transfer-Encoding "
                         "(connection closed)", _client(scope))
                body = json.dumps({"error": {"message": "a request may not carry both Content-Length and "
                                             "Transfer-Encoding", "type": "invalid_request_error"}}).encode()
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            log.info("bubbletea: the client %s closed its connection in the middle of a request", _client(scope))
        except Exception as e:  # noqa: BLE001 -- one line instead of uvicorn's traceback
            log.warning("bubbletea: %s %s failed: %s: %s", scope.get("method", ""), scope.get("path", ""),
                        type(e).__name__, " ".join(str(e).split())[:200])


def _client(scope) -> str:
    return _peer(scope.get("client"))


def _peer(client) -> str:
    client = client or ("?", 0)
    return f"{client[0]}:{client[1]}"


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise GeotrainError(f"--serve-prefill: port {port} on {host} is already in use") from None
        raise GeotrainError(f"--serve-prefill: cannot listen on {host}:{port} ({e.strerror or e})") from None
    sock.listen(512)        # the default backlog resets connections under a burst
    sock.set_inheritable(True)
    return sock


class HttpServer:
    def __init__(self, app, max_connections: int = 256, header_timeout_s: float = 3.0, per_client: int | None = None):
        self.app, self.max_connections, self.header_timeout_s = _FramingGuard(app), max_connections, header_timeout_s
        self.per_client = per_client if per_client is not None else max(2, max_connections // 4)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int, idle_priority: bool = False) -> tuple[str, int]:
        """idle_priority: the server thread, and the worker threads it starts (decoding), take
        only CPU nothing else wants -- for a service sharing cores with training ranks. Safe
        because ranks never wait for the service past their bubble (see bubble_executor)."""
        sock = bind(host, port)
        protocol = type("HeadTimeoutH11", (_HeadTimeoutH11,), {"head_timeout_s": self.header_timeout_s,
                                                               "hard_cap": self.hard_cap(),
                                                               "per_client": self.per_client, **_said_per_server()})
        # backlog=1: how many accepts asyncio tries per wake-up (and retries it schedules when they
        # fail); the kernel's queue is set back to bind's 512 once serving (see the module docstring).
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off", http=protocol,
                                limit_concurrency=self.max_connections, timeout_keep_alive=5,
                                timeout_graceful_shutdown=2, loop="asyncio", backlog=1)
        self._server = server = uvicorn.Server(config)
        out_of_descriptors = _Said()

        def on_loop_error(loop, context: dict) -> None:
            if context.get("message") == "socket.accept() out of system resource":
                out_of_descriptors(f"bubbletea: cannot accept a connection ({context.get('exception')}); "
                                   "backing off and accepting again")
            else:
                loop.default_exception_handler(context)

        def run() -> None:
            if idle_priority:
                lower_own_priority()
            loop = asyncio.new_event_loop()
            loop.set_exception_handler(on_loop_error)
            try:
                loop.run_until_complete(server.serve(sockets=[sock]))
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="bubbletea-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            sock.close()
            raise GeotrainError(f"--serve-prefill: the HTTP server on {host}:{port} did not start")
        sock.listen(512)        # asyncio listened with the backlog above
        return sock.getsockname()[:2]

    def hard_cap(self) -> int:
        """Connections held open at most: twice max_connections, and at most half the descriptor limit."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        half = (soft if soft != resource.RLIM_INFINITY else 1 << 16) // 2
        return max(8, min(2 * self.max_connections, half))

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
