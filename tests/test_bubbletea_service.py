import http.client
import json
import os
import socket
import sys
import threading

import pytest

from geotrain.bubbletea.executor import DecodeWorker, DedicatedExecutor
from geotrain.bubbletea.service import PrefillService
from geotrain.models.llama import build_model
from geotrain.models.presets import PRESETS


class CountingExecutor(DedicatedExecutor):
    def __init__(self, model):
        super().__init__(model)
        self.submitted: list[int] = []

    def submit(self, request_id, tokens):
        self.submitted.append(request_id)
        return super().submit(request_id, tokens)


@pytest.fixture(scope="module")
def service():
    model = build_model(PRESETS["tiny"]).eval()
    ex = CountingExecutor(model)
    svc = PrefillService(ex, DecodeWorker(model), max_queue=4, max_prompt_tokens=48, max_new_tokens=8,
                         token="s3cret")
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


def test_completion_returns_first_token_and_rest(service):
    _, host, port = service
    status, body, _ = call(host, port, "POST", "/v1/completions", {"prompt": "def f(x):", "max_new_tokens": 5})
    assert status == 200
    doc = json.loads(body)
    assert doc["prompt_tokens"] == 9 and len(doc["tokens"]) == 5 and doc["tokens"][0] == doc["first_token"]


def test_streaming_sends_first_token_then_the_rest(service):
    _, host, port = service
    status, body, headers = call(host, port, "POST", "/v1/completions",
                                 {"tokens": [1, 2, 3], "max_new_tokens": 4, "stream": True})
    assert status == 200 and headers["Content-Type"] == "application/x-ndjson"
    lines = [json.loads(x) for x in body.decode().splitlines()]
    assert "first_token" in lines[0] and [x for x in lines if "token" in x and "first_token" not in x]
    assert lines[-1] == {"done": True, "tokens": 4}


@pytest.mark.parametrize("body,status", [
    (b"not json", 400), (b"[1,2]", 400), (b'{"prompt": ""}', 400), (b'{"tokens": [1, "a"]}', 400),
    (b'{"tokens": [999]}', 400), (b'{"prompt": "x", "tokens": [1]}', 400), (b'{"prompt": "x", "bogus": 1}', 400),
    (b'{"prompt": "x", "max_new_tokens": 1000}', 400), (json.dumps({"prompt": "y" * 100}).encode(), 413),
])
def test_malformed_requests_get_4xx_and_service_keeps_serving(service, body, status):
    _, host, port = service
    assert call(host, port, "POST", "/v1/completions", raw=body)[0] == status
    assert call(host, port, "POST", "/v1/completions", {"prompt": "ok"})[0] == 200


def test_auth_paths_and_health(service):
    _, host, port = service
    assert call(host, port, "POST", "/v1/completions", {"prompt": "x"}, token="wrong")[0] == 401
    assert call(host, port, "GET", "/nope")[0] == 404
    assert call(host, port, "GET", "/healthz", token=None)[0] == 200
    status, body, _ = call(host, port, "GET", "/metrics")
    text = body.decode()
    assert status == 200 and "geotrain_bubbletea_queue_length" in text and "ttft_seconds_count" in text


def test_garbage_on_the_socket_does_not_kill_the_service(service):
    _, host, port = service
    s = socket.create_connection((host, port))
    s.sendall(b"\x00\x01garbage\r\n\r\n")
    s.recv(1024)
    s.close()
    assert call(host, port, "GET", "/healthz", token=None)[0] == 200


def test_concurrent_load_each_request_answered_once_or_refused(service):
    svc, host, port = service
    results: list[tuple[int, int | None]] = []
    lock = threading.Lock()

    def client(i):
        req = {"tokens": [i % 200 + 1] * 20, "max_new_tokens": 2}
        status, body, _ = call(host, port, "POST", "/v1/completions", req)
        rid = json.loads(body).get("id") if status == 200 else None
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
    assert sorted(svc.executor.submitted[before:]) == sorted(ok_ids)  # and prefilled exactly once
    assert any(s == 429 for s, _ in results)


def test_no_rank_yet_answers_503_then_serves_once_a_rank_joins():
    import time

    from geotrain.bubbletea.bubble_executor import BubbleExecutor, BubbleWorker
    from geotrain.bubbletea.prefill_cost import PrefillCost

    model = build_model(PRESETS["tiny"]).eval()
    ex = BubbleExecutor()
    svc = PrefillService(ex, DecodeWorker(model), max_queue=4, max_new_tokens=2)
    host, port = svc.serve()
    status, body, headers = call(host, port, "POST", "/v1/completions", {"tokens": [1, 2, 3]}, token=None)
    assert status == 503 and "no training rank" in json.loads(body)["error"] and headers.get("Retry-After") == "1"
    assert json.loads(call(host, port, "GET", "/healthz", token=None)[1])["ready"] is False
    w = BubbleWorker(ex.address, 0, model, PrefillCost(a=0.0, b=0.0005, c=0.0))
    w.connect()
    deadline = time.time() + 10
    while not ex.ready() and time.time() < deadline:
        time.sleep(0.01)
    assert json.loads(call(host, port, "GET", "/healthz", token=None)[1])["ready"] is True
    stop = threading.Event()
    rank = threading.Thread(target=lambda: [w.fill(0.05) or time.sleep(0.01) for _ in iter(stop.is_set, True)])
    rank.start()
    status, body, _ = call(host, port, "POST", "/v1/completions", {"tokens": [1, 2, 3]}, token=None)
    stop.set()
    rank.join(5)
    assert status == 200 and json.loads(body)["prefill_on"] == "rank 0"
    w.close()
    svc.close()
    ex.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread scheduling policy is Linux's")
def test_idle_priority_service_handles_requests_on_idle_threads():
    from geotrain.bubbletea.idle_priority import lower_own_priority

    model = build_model(PRESETS["tiny"]).eval()
    seen = []

    class Recording(DedicatedExecutor):
        def submit(self, request_id, tokens):
            seen.append(os.sched_getscheduler(0))          # runs on the request's handler thread
            return super().submit(request_id, tokens)

    probe = {}
    t = threading.Thread(target=lambda: probe.update(got=lower_own_priority()))
    t.start()
    t.join()
    ex = Recording(model)
    svc = PrefillService(ex, DecodeWorker(model), max_queue=4, max_new_tokens=2)
    host, port = svc.serve(idle_priority=True)
    assert call(host, port, "POST", "/v1/completions", {"tokens": [1, 2, 3]}, token=None)[0] == 200
    svc.close()
    ex.close()
    assert seen == [os.SCHED_IDLE if probe["got"] == "idle" else os.SCHED_OTHER]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER        # the caller's thread is untouched
