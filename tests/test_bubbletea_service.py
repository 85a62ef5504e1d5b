"""The OpenAI-compatible BubbleTea API: answers, errors, abuse, admission, exactly-once."""

import glob
import http.client
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time

import pytest
from _descriptors import descriptors_exhausted
from prometheus_client.parser import text_string_to_metric_families

from geotrain.bubbletea.executor import DecodeWorker, DedicatedExecutor
from geotrain.bubbletea.inference import prefill
from geotrain.bubbletea.service import PrefillService
from geotrain.models.llama import build_model
from geotrain.models.presets import PRESETS

MODEL = "geotrain-tiny"


class CountingExecutor(DedicatedExecutor):
    def __init__(self, model):
        super().__init__(model)
        self.submitted: list[int] = []

    def submit(self, request_id, tokens):
        self.submitted.append(request_id)
        return super().submit(request_id, tokens)


@pytest.fixture(scope="module")
def model():
    return build_model(PRESETS["tiny"]).eval()


@pytest.fixture(scope="module")
def service(model):
    ex = CountingExecutor(model)
    svc = PrefillService(ex, DecodeWorker(model), max_queue=4, max_prompt_tokens=48, max_new_tokens=8,
                         token="s3cret", read_timeout_s=1.0, head_timeout_s=1.0)
    host, port = svc.serve()
    yield svc, host, port
    svc.close()
    ex.close()


def call(host, port, method, path, body=None, token="s3cret", raw=None):
    c = http.client.HTTPConnection(host, port, timeout=60)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.request(method, path, body=data, headers=headers)
    r = c.getresponse()
    out = r.status, r.read(), dict(r.getheaders())
    c.close()
    return out


def test_completion_greedy_first_token_is_the_prefills(service, model):
    _, host, port = service
    status, body, _ = call(host, port, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": "def f(x):", "max_tokens": 5, "temperature": 0})
    assert status == 200
    doc = json.loads(body)
    ch = doc["choices"][0]
    assert doc["object"] == "text_completion" and doc["usage"] == {"prompt_tokens": 9, "completion_tokens": 5,
                                                                   "total_tokens": 14}
    assert len(ch["token_ids"]) == 5 and ch["finish_reason"] == "length"
    assert ch["token_ids"][0] == prefill(model, list(b"def f(x):"))[0]


def test_streaming_is_server_sent_events_ending_done_with_the_same_text(service):
    _, host, port = service
    req = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0}
    whole = json.loads(call(host, port, "POST", "/v1/completions", req)[1])["choices"][0]
    status, body, headers = call(host, port, "POST", "/v1/completions", {**req, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [x for x in body.decode().split("\n\n") if x]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_seeded_sampling_repeats_and_stop_strings_cut(service):
    _, host, port = service
    req = {"model": MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    a, b = (json.loads(call(host, port, "POST", "/v1/completions", req)[1])["choices"][0] for _ in range(2))
    assert a["token_ids"] == b["token_ids"]
    greedy = json.loads(call(host, port, "POST", "/v1/completions", {**req, "temperature": 0})[1])["choices"][0]
    stop = greedy["text"][2:4]
    cut = json.loads(call(host, port, "POST", "/v1/completions", {**req, "temperature": 0, "stop": [stop]})[1])
    assert cut["choices"][0]["finish_reason"] == "stop" and stop not in cut["choices"][0]["text"]
    assert greedy["text"].startswith(cut["choices"][0]["text"])


@pytest.mark.parametrize("body,status", [
    (b"not json", 400), (b"[1,2]", 400), (b'{"prompt": ""}', 400), (b'{"prompt": [1, "a"]}', 400),
    (b'{"prompt": [999]}', 400), (b'{"prompt": "x", "bogus": 1}', 400), (b'{"prompt": "x", "max_tokens": 1000}', 400),
    (b'{"prompt": "\\ud800"}', 400), (b"[" * 100000, 400), (b'{"prompt": [' + b"7" * 5000 + b"]}", 400),
    (b'{"prompt": "x", "temperature": "hot"}', 400), (b'{"prompt": "x", "model": "gpt-4"}', 404),
    (b"\xff\xfe", 400), (json.dumps({"prompt": "y" * 100}).encode(), 400)
])
def test_malformed_requests_get_4xx_json_and_service_keeps_serving(service, body, status):
    _, host, port = service
    got, text, _ = call(host, port, "POST", "/v1/completions", raw=body)
    assert got == status and "message" in json.loads(text)["error"]
    assert call(host, port, "POST", "/v1/completions", {"prompt": "ok", "max_tokens": 1})[0] == 200


def test_an_oversized_body_is_refused_before_it_is_read(service):
    _, host, port = service
    s = socket.create_connection((host, port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
              b"Content-Length: %d\r\n\r\n{\"prompt\": \"" % (2 << 20))
    s.settimeout(10)
    head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    s.close()


def test_404_and_401_with_a_body_leave_the_keep_alive_connection_usable(service):
    _, host, port = service
    c = http.client.HTTPConnection(host, port, timeout=30)
    for path, token in (("/v1/nope", "s3cret"), ("/v1/completions", "wrong")):
        c.request("POST", path, body=json.dumps({"prompt": "x" * 500}), headers={"Authorization": f"Bearer {token}"})
        r = c.getresponse()
        assert r.status in (401, 404) and "error" in json.loads(r.read())
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": "ok", "max_tokens": 1}),
              headers={"Authorization": "Bearer s3cret"})
    assert c.getresponse().status == 200
    c.close()


def test_auth_health_and_metrics_parse_with_prometheus_client(service):
    _, host, port = service
    assert call(host, port, "GET", "/v1/models", token="wrong")[0] == 401
    assert call(host, port, "GET", "/nope")[0] == 404
    assert call(host, port, "GET", "/healthz", token=None)[0] == 200
    assert call(host, port, "POST", "/v1/completions", {"prompt": "ok", "max_tokens": 1})[0] == 200
    status, body, _ = call(host, port, "GET", "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert status == 200 and {"geotrain_bubbletea_queue_length", "geotrain_bubbletea_prefill_share"} <= set(families)
    assert any(s.name == "geotrain_bubbletea_ttft_seconds_count" and s.value > 0
               for s in families["geotrain_bubbletea_ttft_seconds"].samples)


def test_garbage_on_the_socket_does_not_kill_the_service(service):
    _, host, port = service
    s = socket.create_connection((host, port))
    s.sendall(b"\x00\x01garbage\r\n\r\n")
    s.recv(1024)
    s.close()
    assert call(host, port, "GET", "/healthz", token=None)[0] == 200


def test_slow_head_and_slow_body_are_cut_off(service):
    _, host, port = service
    drip = socket.create_connection((host, port))
    drip.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")       # the head never ends
    drip.settimeout(10)
    t = time.monotonic()
    assert drip.recv(1024) == b"" and time.monotonic() - t < 5             # closed after ~1 s
    drip.close()
    slow = socket.create_connection((host, port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
                 b"Content-Length: 100\r\n\r\n{\"pro")
    slow.settimeout(10)
    assert b" 408 " in slow.recv(4096).split(b"\r\n")[0] + b" "
    slow.close()


def test_an_idle_keep_alive_is_closed_quietly_a_silent_opener_with_a_line(model, caplog):
    """The 3 s head deadline also ends idle keep-alive connections (uvicorn's own timer is 5 s):
    that is a client's pool at rest, not a line for the console; an opener that never sent a head is."""
    ex = DedicatedExecutor(model)
    svc = PrefillService(ex, DecodeWorker(model), max_queue=4, max_new_tokens=2, head_timeout_s=0.5)
    host, port = svc.serve()
    pooled = http.client.HTTPConnection(host, port, timeout=10)
    pooled.request("GET", "/healthz")
    assert pooled.getresponse().read()
    silent = socket.create_connection((host, port))
    silent_port = silent.getsockname()[1]
    try:
        with caplog.at_level(logging.INFO, logger="geotrain.bubbletea"):
            silent.settimeout(5)
            assert silent.recv(1) == b""                      # closed at the deadline
            pooled.sock.settimeout(5)
            assert pooled.sock.recv(1) == b""                 # so is the idle keep-alive
            time.sleep(0.2)
    finally:
        silent.close()
        pooled.close()
        svc.close()
        ex.close()
    said = [r.getMessage() for r in caplog.records if "no complete request" in r.getMessage()]
    assert len(said) == 1 and f"from 127.0.0.1:{silent_port} that" in said[0], said


def test_connections_past_the_bound_get_503(model, caplog):
    """...and the refusals are one log line (uvicorn logged one per 503: a flood's worth)."""
    ex = DedicatedExecutor(model)
    svc = PrefillService(ex, DecodeWorker(model), max_queue=4, max_new_tokens=2, max_connections=6)
    host, port = svc.serve()
    held = []
    for i in range(6):          # from six addresses: one address holds a quarter of the slots at most
        s = socket.create_connection((host, port), source_address=(f"127.0.0.{2 + i}", 0))
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        s.recv(4096)
        held.append(s)          # kept alive, idle
    try:
        with caplog.at_level(logging.INFO):
            assert [call(host, port, "GET", "/healthz", token=None)[0] for _ in range(3)] == [503] * 3
    finally:
        for s in held:
            s.close()
    said = [r.getMessage() for r in caplog.records if "concurrency" in r.getMessage()]
    assert said == ["bubbletea: Exceeded concurrency limit."], said
    time.sleep(0.2)
    assert call(host, port, "GET", "/healthz", token=None)[0] == 200
    svc.close()
    ex.close()


def test_one_address_dripping_heads_leaves_another_served(model):
    """Slowloris: one address opens more connections than the service takes and sends its heads a
    byte at a time; it held every slot until the head deadline (the rest got 503 or were closed).
    Now it holds its share (max_connections // 4), and another address is answered at once."""
    ex = DedicatedExecutor(model)
    svc = PrefillService(ex, DecodeWorker(model), max_queue=4, max_new_tokens=2, max_connections=8)
    host, port = svc.serve()
    drips = [socket.create_connection((host, port)) for _ in range(20)]
    stop = threading.Event()

    def drip() -> None:
        while not stop.is_set():
            for s in drips:
                try:
                    s.send(b"X-Slow: 1\r\n" if s.fileno() >= 0 else b"")
                except OSError:
                    pass
            stop.wait(0.2)

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        time.sleep(0.5)
        t = time.monotonic()
        c = http.client.HTTPConnection(host, port, timeout=10, source_address=("127.0.0.2", 0))
        c.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}))
        r = c.getresponse()
        assert r.status == 200 and json.loads(r.read())["choices"], r.status
        assert time.monotonic() - t < 3
        c.close()
    finally:
        stop.set()
        dripper.join()
        for s in drips:
            s.close()
        svc.close()
        ex.close()


def test_a_flood_holds_at_most_the_hard_cap_of_descriptors(model):
    """Idle openers were each held until the head deadline: 400 of them left a launcher under
    `ulimit -n 200` unable to open a file. Past twice max_connections a connection is closed at once."""
    ex = DedicatedExecutor(model)
    svc = PrefillService(ex, DecodeWorker(model), max_queue=4, max_new_tokens=2, max_connections=4,
                         head_timeout_s=30)
    host, port = svc.serve()
    held = [socket.create_connection((host, port), source_address=(f"127.0.0.{2 + i}", 0)) for i in range(24)]
    try:
        closed = 0
        for s in held:
            s.settimeout(0.5)
            try:
                closed += s.recv(1) == b""
            except TimeoutError:
                pass                                # held open (within the cap), waiting for a head
        assert closed >= 24 - 8, closed             # hard cap: 2 x max_connections
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert call(host, port, "GET", "/healthz", token=None)[0] == 200
    svc.close()
    ex.close()


def test_out_of_descriptors_is_one_line_and_accepting_goes_on(model, caplog):
    """asyncio logged a traceback for every queued connection when accept() met EMFILE, and
    scheduled a retry for each (10,084 tracebacks in 8 s). Now one line, and the queued
    connection is served once descriptors are free."""
    ex = DedicatedExecutor(model)
    svc = PrefillService(ex, DecodeWorker(model), max_queue=4, max_new_tokens=2)
    host, port = svc.serve()
    client = socket.socket()
    caplog.set_level(logging.INFO)
    with descriptors_exhausted():
        client.connect((host, port))                # a request queued: accept() meets EMFILE
        client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(2.5)
    try:
        client.settimeout(10)
        assert client.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        client.close()
        svc.close()
        ex.close()
    said = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(said) == 1 and "cannot accept a connection" in said[0].getMessage(), \
        [(r.name, r.getMessage()[:80]) for r in said[:5]]
    assert not any(r.exc_info for r in caplog.records)


def test_client_disconnect_mid_stream_is_one_log_line(service, caplog):
    svc, host, port = service
    before = svc.stats.disconnects
    with caplog.at_level(logging.WARNING, logger="geotrain.bubbletea"):
        s = socket.create_connection((host, port))
        body = json.dumps({"prompt": "hello", "max_tokens": 8, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data: " not in got:
            got += s.recv(4096)
        s.close()
        deadline = time.time() + 10
        while svc.stats.disconnects == before and time.time() < deadline:
            call(host, port, "GET", "/healthz", token=None)
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert svc.wait_idle(10)


def _exchange(host, port, data: bytes, wait_s: float = 2.0) -> bytes:
    """Send `data` on a fresh connection; everything answered until the server closes it (then b"<EOF>"
    ends it) or `wait_s` of silence (the connection left open)."""
    s = socket.create_connection((host, port))
    s.sendall(data)
    s.settimeout(wait_s)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
        out += b"<EOF>"
    except TimeoutError:
        pass
    s.close()
    return out


def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(service, caplog):
    """Issue #30: answered without closing, so a request smuggled behind the chunked body (a proxy
    reading Content-Length would not see it) was served too."""
    _, host, port = service
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n\r\n"
    with caplog.at_level(logging.INFO, logger="geotrain.bubbletea"):
        got = _exchange(host, port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
                        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled)
    assert got.startswith(b"HTTP/1.1 400 ") and got.endswith(b"<EOF>"), got
    assert got.count(b"HTTP/1.1 ") == 1 and MODEL.encode() not in got, got       # the second was not served
    assert sum("both Content-Length and Transfer-Encoding" in r.getMessage() for r in caplog.records) == 1
    for bad in (b"Transfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n",      # a broken chunk
                b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd"):                  # two lengths
        got = _exchange(host, port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + bad + smuggled)
        assert got.startswith(b"HTTP/1.1 400 ") and got.endswith(b"<EOF>") and got.count(b"HTTP/1.1 ") == 1, got
    assert call(host, port, "GET", "/healthz", token=None)[0] == 200


def test_a_client_gone_in_the_middle_of_its_body_is_one_log_line(service, capfd, caplog):
    """Was uvicorn's ~60-line ASGI traceback (ClientDisconnect) on the training console per request."""
    _, host, port = service
    with caplog.at_level(logging.INFO, logger="geotrain.bubbletea"):
        for _ in range(3):
            s = socket.create_connection((host, port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\"")
            time.sleep(0.2)
            s.close()
        deadline = time.time() + 10
        while time.time() < deadline and sum("in the middle of a request" in r.getMessage()
                                             for r in caplog.records) < 3:
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith(("geotrain", "uvicorn"))]
    assert sum("in the middle of a request" in x for x in lines) == 3, lines
    assert not [r for r in caplog.records if r.exc_info], lines                # no traceback logged
    assert "Traceback" not in capfd.readouterr().err
    assert call(host, port, "GET", "/healthz", token=None)[0] == 200


def test_concurrent_load_each_request_answered_once_or_refused(service):
    svc, host, port = service
    results: list[tuple[int, str | None]] = []
    lock = threading.Lock()

    def client(i):
        req = {"prompt": [i % 200 + 1] * 20, "max_tokens": 2}
        status, body, headers = call(host, port, "POST", "/v1/completions", req)
        rid = json.loads(body).get("id") if status == 200 else None
        if status == 429:
            assert headers.get("retry-after") == "1"
        with lock:
            results.append((status, rid))

    before = len(svc.executor.submitted)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 40
    assert {s for s, _ in results} <= {200, 429}
    ok_ids = [rid for s, rid in results if s == 200]
    assert len(ok_ids) == len(set(ok_ids)) >= 4          # each accepted request answered exactly once
    assert sorted(svc.executor.submitted[before:]) == sorted(int(r.split("-")[1]) for r in ok_ids)
    assert any(s == 429 for s, _ in results)


def test_no_rank_yet_answers_503_then_serves_once_a_rank_joins(model):
    from geotrain.bubbletea.bubble_executor import BubbleExecutor, BubbleWorker
    from geotrain.bubbletea.prefill_cost import PrefillCost

    ex = BubbleExecutor()
    svc = PrefillService(ex, DecodeWorker(model), max_queue=4, max_new_tokens=2)
    host, port = svc.serve()
    status, body, headers = call(host, port, "POST", "/v1/completions", {"prompt": [1, 2, 3]}, token=None)
    assert status == 503 and "no training rank" in json.loads(body)["error"]["message"]
    assert headers.get("retry-after") == "1"
    assert json.loads(call(host, port, "GET", "/healthz", token=None)[1])["ready"] is False
    w = BubbleWorker(ex.address, 0, model, PrefillCost(a=0.0, b=0.0005, c=0.0), secret=ex.secret)
    w.connect()
    deadline = time.time() + 10
    while not ex.ready() and time.time() < deadline:
        time.sleep(0.01)
    assert json.loads(call(host, port, "GET", "/healthz", token=None)[1])["ready"] is True
    stop = threading.Event()
    rank = threading.Thread(target=lambda: [w.fill(0.05) or time.sleep(0.01) for _ in iter(stop.is_set, True)])
    rank.start()
    status, body, _ = call(host, port, "POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}, token=None)
    stop.set()
    rank.join(5)
    assert status == 200 and json.loads(body)["choices"][0]["prefill_on"] == "rank 0"
    w.close()
    svc.close()
    ex.close()


def test_port_in_use_is_one_line_exit_2_and_leaves_no_temp_dir(capfd):
    from _cli import geotrain

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    pattern = os.path.join(tempfile.gettempdir(), "geotrain-bt-*")
    before = set(glob.glob(pattern))
    rc, _, err = geotrain(capfd, "train", "examples/tiny_2dc.toml", "--steps", "1", "--no-progress", "--wan", "off",
                          "--serve-prefill", port)
    busy.close()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "in use" in err, err
    assert set(glob.glob(pattern)) <= before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread scheduling policy is Linux's")
def test_idle_priority_service_handles_requests_on_idle_threads(model):
    from geotrain.bubbletea.idle_priority import lower_own_priority

    seen = []

    class Recording(DedicatedExecutor):
        def submit(self, request_id, tokens):
            seen.append(os.sched_getscheduler(0))          # runs on the server's thread
            return super().submit(request_id, tokens)

    probe = {}
    t = threading.Thread(target=lambda: probe.update(got=lower_own_priority()))
    t.start()
    t.join()
    ex = Recording(model)
    svc = PrefillService(ex, DecodeWorker(model), max_queue=4, max_new_tokens=2)
    host, port = svc.serve(idle_priority=True)
    assert call(host, port, "POST", "/v1/completions", {"prompt": [1, 2, 3]}, token=None)[0] == 200
    svc.close()
    ex.close()
    assert seen == [os.SCHED_IDLE if probe["got"] == "idle" else os.SCHED_OTHER]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER        # the caller's thread is untouched
