"""Prefill on 'training ranks' (threads here) through the real service and wire protocol."""

import http.client
import json
import threading
import time

from geotrain.bubbletea.bubble_executor import BubbleExecutor, BubbleWorker
from geotrain.bubbletea.executor import DecodeWorker
from geotrain.bubbletea.inference import prefill
from geotrain.bubbletea.prefill_cost import PrefillCost
from geotrain.bubbletea.service import PrefillService
from geotrain.models.llama import build_model
from geotrain.models.presets import PRESETS


def test_ranks_prefill_in_bubbles_and_answers_match_a_plain_prefill():
    model = build_model(PRESETS["tiny"]).eval()
    ex = BubbleExecutor(min_chunk=4)
    svc = PrefillService(ex, DecodeWorker(model), max_queue=16, max_new_tokens=4)
    host, port = svc.serve()
    # A cost model that makes a 20 ms bubble hold ~25 tokens: requests get chunked.
    cost = PrefillCost(a=0.0, b=0.0008, c=0.0)
    workers = [BubbleWorker(ex.address, r, model, cost) for r in range(2)]
    for w in workers:
        w.connect()
    stop = threading.Event()
    overruns = []

    def rank_loop(w):
        while not stop.is_set():
            t = time.perf_counter()
            used = w.fill(0.02)   # a predicted 20 ms bubble
            if used > 0.2:        # generous: CPU time is noisy, but a chunk must not run wild
                overruns.append(used)
            time.sleep(max(0.0, 0.02 - (time.perf_counter() - t)))  # the "training" part

    threads = [threading.Thread(target=rank_loop, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    prompts = [list(range(1, 1 + n)) for n in (5, 30, 61)]
    answers = {}

    def client(p):
        c = http.client.HTTPConnection(host, port, timeout=60)
        c.request("POST", "/v1/completions", json.dumps({"tokens": p, "max_new_tokens": 1}))
        answers[len(p)] = json.loads(c.getresponse().read())
        c.close()

    cts = [threading.Thread(target=client, args=(p,)) for p in prompts]
    for t in cts:
        t.start()
    for t in cts:
        t.join()
    stop.set()
    for t in threads:
        t.join()
    for w in workers:
        w.close()
    svc.close()
    ex.close()
    assert not overruns
    for p in prompts:
        want, _ = prefill(model, p)
        got = answers[len(p)]
        assert got["first_token"] == want, got
        assert got["prefill_on"].startswith("rank ")
    assert sum(w.chunks for w in workers) > len(prompts)   # the long prompts were chunked
    assert ex.utilization_gained() > 0


def test_a_request_of_a_vanished_rank_restarts_elsewhere():
    model = build_model(PRESETS["tiny"]).eval()
    ex = BubbleExecutor(min_chunk=2)
    cost = PrefillCost(a=0.0, b=0.001, c=0.0)
    fut = ex.submit(7, list(range(1, 41)))
    w1 = BubbleWorker(ex.address, 0, model, cost)
    w1.connect()
    w1.fill(0.012)             # ~12 tokens, then the rank dies
    w1.close()
    time.sleep(0.2)
    w2 = BubbleWorker(ex.address, 1, model, cost)
    w2.connect()
    deadline = time.time() + 30
    while not fut.done() and time.time() < deadline:
        w2.fill(0.05)
    out = fut.result(timeout=1)
    assert out.where == "rank 1"
    assert out.first_token == prefill(model, list(range(1, 41)))[0]
    assert out.kv_shape[-2] == 40          # (2, layers, 1, kv_heads, tokens, head_dim)
    w2.close()
    ex.close()
