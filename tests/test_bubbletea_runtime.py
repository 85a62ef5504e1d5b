"""BubbleTea during real training: requests through the real API, prefilled by training ranks."""

import http.client
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from geotrain.bubbletea.inference import prefill
from geotrain.models.llama import build_model
from geotrain.models.presets import PRESETS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_requests_during_training_are_prefilled_by_ranks_and_answered_once(tmp_path):
    port = _free_port()
    argv = [sys.executable, "-m", "geotrain", "train", "examples/tiny_2dc.toml", "--steps", "40", "--out",
            str(tmp_path / "run"), "--no-progress", "--wan", "off", "--serve-prefill", str(port),
            "--prefill-token", "tok"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    answers: list[tuple[int, dict]] = []
    lock = threading.Lock()
    prompts = [[(5 * i + k) % 250 + 1 for k in range(24)] for i in range(12)]

    def client(i: int) -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=180)
                c.request("POST", "/v1/completions", json.dumps({"prompt": prompts[i], "max_tokens": 2,
                                                                 "temperature": 0}),
                          headers={"Authorization": "Bearer tok"})
                r = c.getresponse()
                doc = json.loads(r.read())
                c.close()
                if r.status == 503 and "no training rank" in doc["error"]["message"]:
                    time.sleep(float(r.getheader("Retry-After", "1")))   # no rank yet: retry, as told
                    continue
                with lock:
                    answers.append((r.status, {**(doc["choices"][0] if r.status == 200 else doc), "i": i,
                                               "id": doc.get("id")}))
                return
            except ConnectionRefusedError:
                time.sleep(0.3)   # the service is not up yet

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
        time.sleep(0.2)
    official = _official_client_checks(port)
    with socket.create_connection(("127.0.0.1", port)) as bad:      # dropped with a line on the console
        bad.sendall(b"\x00\x01garbage\r\n\r\n")
        bad.recv(1024)
    for t in threads:
        t.join(200)
    out, _ = proc.communicate(timeout=300)
    assert official["models"] == ["geotrain-tiny"] and official["text"] and official["streamed"][-1] == "length"
    # One keep-alive connection throughout, reused after the 404 and the 401.
    assert len(official["client_ports"]) == 4 and len(set(official["client_ports"])) == 1, official
    assert official["training_step"] >= 1
    assert proc.returncode == 0, out
    # The CLI sets logging up: the service's INFO lines (dropped clients) reach stderr, formatted.
    assert " INFO geotrain.bubbletea: bubbletea: dropped a malformed request from 127.0.0.1:" in out, out
    assert "Traceback" not in out, out
    assert len(answers) == len(prompts)
    ok = [d for s, d in answers if s == 200]
    assert len({d["id"] for d in ok}) == len(ok)                 # answered exactly once
    assert all(s in (200, 429, 503) for s, _ in answers)
    model = build_model(PRESETS["tiny"]).eval()
    for d in ok:
        assert d["token_ids"][0] == prefill(model, prompts[d["i"]])[0]
    on_ranks = [d for d in ok if d["prefill_on"].startswith("rank ")]
    assert on_ranks, [d["prefill_on"] for d in ok]               # training ranks did the prefill
    trace = (tmp_path / "run" / "measured_trace.jsonl").read_text()
    assert '"kind": "prefill"' in trace
    _check_report(tmp_path / "run", answered=len(ok) + 2)


def _check_report(run, answered: int) -> None:
    """The run's report says what is predicted (uncalibrated here) and what measured, has a
    BubbleTea section from the service's own numbers, and a Chrome trace sits beside it."""
    import subprocess

    doc = json.loads((run / "bubbletea.json").read_text())
    assert doc["answered"] >= answered and doc["prefill_s"] > 0 and doc["bubble_s"] > doc["prefill_s"]
    chrome = json.loads((run / "measured_trace.chrome.json").read_text())
    assert any(ev.get("ph") == "X" and ev.get("name") == "prefill" for ev in chrome["traceEvents"])
    r = subprocess.run([sys.executable, "-m", "geotrain", "report", str(run)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "predicted, uncalibrated" in r.stdout and "--profile" in r.stdout
    assert "BubbleTea (measured)" in r.stdout and "TTFT p99" in r.stdout and "prefill share of bubble time" in r.stdout
    html = (run / "report.html").read_text()
    assert "<h2>BubbleTea" in html and "UNCALIBRATED" in html


def _official_client_checks(port: int) -> dict:
    """The official openai client against the live run: list, complete, stream, and keep using
    one keep-alive connection through a 404 and a 401; then /metrics shows training progress."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(base + "/healthz").json()["ready"]:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    shared = httpx.Client(timeout=120)
    good = openai.OpenAI(base_url=base + "/v1", api_key="tok", http_client=shared, max_retries=0)
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", http_client=shared, max_retries=0)

    def port_of(response) -> int:
        return response.extensions["network_stream"].get_extra_info("client_addr")[1]

    got = {"client_ports": []}
    r = good.models.with_raw_response.list()
    got["models"] = [m.id for m in r.parse().data]
    got["client_ports"].append(port_of(r.http_response))
    try:
        good.completions.create(model="no-such-model", prompt="x" * 200, max_tokens=2)
    except openai.NotFoundError as e:
        got["client_ports"].append(port_of(e.response))
    try:
        bad.completions.create(model="geotrain-tiny", prompt="x" * 200, max_tokens=2)
    except openai.AuthenticationError as e:
        got["client_ports"].append(port_of(e.response))
    r = good.completions.with_raw_response.create(model="geotrain-tiny", prompt="def f(x):", max_tokens=4)
    got["text"] = r.parse().choices[0].text
    got["client_ports"].append(port_of(r.http_response))
    got["streamed"] = [c.choices[0].finish_reason for c in good.completions.create(
        model="geotrain-tiny", prompt="import os", max_tokens=3, stream=True)]
    time.sleep(1.0)
    text = shared.get(base + "/metrics", headers={"Authorization": "Bearer tok"}).text
    got["training_step"] = next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                                if s.name == "geotrain_train_step")
    shared.close()
    return got
