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
            str(tmp_path / "run"), "--no-progress", "--wan", "off", "--serve-prefill", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    answers: list[tuple[int, dict]] = []
    lock = threading.Lock()
    prompts = [[(5 * i + k) % 250 + 1 for k in range(24)] for i in range(12)]

    def client(i: int) -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=180)
                c.request("POST", "/v1/completions", json.dumps({"tokens": prompts[i], "max_new_tokens": 2}))
                r = c.getresponse()
                doc = json.loads(r.read())
                c.close()
                if r.status == 503 and "no training rank" in doc.get("error", ""):
                    time.sleep(float(r.getheader("Retry-After", "1")))   # no rank yet: retry, as told
                    continue
                with lock:
                    answers.append((r.status, {**doc, "i": i}))
                return
            except ConnectionRefusedError:
                time.sleep(0.3)   # the service is not up yet

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join(200)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert len(answers) == len(prompts)
    ok = [d for s, d in answers if s == 200]
    assert len({d["id"] for d in ok}) == len(ok)                 # answered exactly once
    assert all(s in (200, 429, 503) for s, _ in answers)
    model = build_model(PRESETS["tiny"]).eval()
    for d in ok:
        assert d["first_token"] == prefill(model, prompts[d["i"]])[0]
    on_ranks = [d for d in ok if d["prefill_on"].startswith("rank ")]
    assert on_ranks, [d["prefill_on"] for d in ok]               # training ranks did the prefill
    trace = (tmp_path / "run" / "measured_trace.jsonl").read_text()
    assert '"kind": "prefill"' in trace
