"""Prefill on 'training ranks' (threads here) through the real service and wire protocol."""

import http.client
import json
import os
import socket
import threading
import time

from _descriptors import descriptors_exhausted
from _drip import drip_until_closed

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
    workers = [BubbleWorker(ex.address, r, model, cost, secret=ex.secret) for r in range(2)]
    for w in workers:
        w.connect()
    deadline = time.time() + 10
    while not ex.ready() and time.time() < deadline:   # the service answers 503 until a rank has joined
        time.sleep(0.01)
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
        c.request("POST", "/v1/completions", json.dumps({"prompt": p, "max_tokens": 1, "temperature": 0}))
        answers[len(p)] = json.loads(c.getresponse().read())["choices"][0]
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
        assert got["token_ids"][0] == want, got
        assert got["prefill_on"].startswith("rank ")
    assert sum(w.chunks for w in workers) > len(prompts)   # the long prompts were chunked
    assert ex.utilization_gained() > 0


def test_a_request_of_a_vanished_rank_restarts_elsewhere():
    model = build_model(PRESETS["tiny"]).eval()
    ex = BubbleExecutor(min_chunk=2)
    cost = PrefillCost(a=0.0, b=0.001, c=0.0)
    fut = ex.submit(7, list(range(1, 41)))
    w1 = BubbleWorker(ex.address, 0, model, cost, secret=ex.secret)
    w1.connect()
    # Exactly one chunk of ~12 tokens (a fill could run several: real chunks beat this cost model),
    # then the rank dies.
    from geotrain.bubbletea.wire import recv_frame, send_frame

    send_frame(w1._sock, {"op": "poll", "budget": 0.012})
    chunk, _ = recv_frame(w1._sock)
    assert chunk["op"] == "chunk" and 0 < len(chunk["tokens"]) < 40
    w1._run_chunk(chunk)
    w1.close()
    time.sleep(0.2)
    w2 = BubbleWorker(ex.address, 1, model, cost, secret=ex.secret)
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


FAKE_SECRET = b"s" * 32


def _fake_service():
    """A listening socket standing in for the executor: the test decides what it answers. The
    connection it accepts has passed the executor's handshake (`accepted.get()` gives it)."""
    import queue
    import socket

    from geotrain.transport.auth import ANY_RANK, BUBBLETEA, server_handshake

    srv = socket.create_server(("127.0.0.1", 0))
    accepted: queue.Queue = queue.Queue()

    def accept() -> None:
        conn, _ = srv.accept()
        server_handshake(conn, FAKE_SECRET, BUBBLETEA, ANY_RANK)
        accepted.put(conn)

    threading.Thread(target=accept, daemon=True).start()
    return srv, srv.getsockname()[:2], accepted


def test_a_late_answer_ends_the_bubble_and_is_dropped_when_it_comes():
    from geotrain.bubbletea.wire import recv_frame, send_frame

    model = build_model(PRESETS["tiny"]).eval()
    srv, addr, accepted = _fake_service()
    w = BubbleWorker(addr, 0, model, PrefillCost(a=0.0, b=0.0001, c=0.0), secret=FAKE_SECRET)
    w.connect()
    conn = accepted.get(timeout=10)
    recv_frame(conn)                                   # hello
    got = []
    th = threading.Thread(target=lambda: got.append(w.fill(0.03)), daemon=True)  # the service does not answer
    th.start()
    th.join(2)
    assert not th.is_alive() and got[0] < 0.05        # the rank left at the bubble's end, not at the answer
    recv_frame(conn)                                   # that poll
    send_frame(conn, {"op": "chunk", "id": 1, "tokens": [1, 2, 3], "context": 0, "last": False})  # too late

    def answer_next_poll():
        msg, _ = recv_frame(conn)
        assert msg["op"] == "poll"
        send_frame(conn, {"op": "none"})

    th = threading.Thread(target=answer_next_poll)
    th.start()
    w.fill(0.5)                                        # reads and drops the stale chunk, then gets "none"
    th.join(5)
    assert w.chunks == 0                               # the late proposal never ran
    w.close()
    conn.close()
    srv.close()


def test_a_proposal_that_no_longer_fits_is_not_run():
    from geotrain.bubbletea.wire import recv_frame, send_frame

    model = build_model(PRESETS["tiny"]).eval()
    srv, addr, accepted = _fake_service()
    w = BubbleWorker(addr, 0, model, PrefillCost(a=0.0, b=0.001, c=0.0), secret=FAKE_SECRET)   # 20 tokens: 20 ms
    w.connect()
    conn = accepted.get(timeout=10)
    recv_frame(conn)

    def answer():
        recv_frame(conn)
        send_frame(conn, {"op": "chunk", "id": 1, "tokens": list(range(1, 21)), "context": 0, "last": True})

    th = threading.Thread(target=answer)
    th.start()
    w.fill(0.010)
    th.join(5)
    assert w.chunks == 0
    w.close()
    conn.close()
    srv.close()


def test_an_ignored_proposal_is_proposed_again():
    """The service counts tokens as done only when told, so a rank may skip what it was offered."""
    from geotrain.bubbletea.wire import recv_frame, send_frame

    model = build_model(PRESETS["tiny"]).eval()
    ex = BubbleExecutor(min_chunk=1)
    prompt = list(range(1, 21))
    fut = ex.submit(3, prompt)
    w = BubbleWorker(ex.address, 0, model, PrefillCost(a=0.0, b=0.0005, c=0.0), secret=ex.secret)
    w.connect()
    send_frame(w._sock, {"op": "poll", "budget": 1.0})
    offered, _ = recv_frame(w._sock)                   # taken, never run
    assert offered["op"] == "chunk" and offered["context"] == 0
    deadline = time.time() + 30
    while not fut.done() and time.time() < deadline:
        w.fill(0.2)
    assert fut.result(timeout=1).first_token == prefill(model, prompt)[0]
    assert w.chunks >= 1
    w.close()
    ex.close()


def test_idle_priority_worker_computes_on_a_sched_idle_thread():
    import sys

    model = build_model(PRESETS["tiny"]).eval()
    ex = BubbleExecutor(min_chunk=1)
    fut = ex.submit(1, list(range(1, 9)))
    w = BubbleWorker(ex.address, 0, model, PrefillCost(a=0.0, b=0.0005, c=0.0), priority="idle",
                     secret=ex.secret)
    w.connect()
    deadline = time.time() + 30
    while not fut.done() and time.time() < deadline:
        w.fill(0.1)
    assert fut.result(timeout=1).first_token == prefill(model, list(range(1, 9)))[0]
    if sys.platform.startswith("linux"):
        assert w._runner.priority in ("idle", "nice 19")
        tid = w._runner.native_id
        if w._runner.priority == "idle":
            assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        assert os.sched_getscheduler(0) != getattr(os, "SCHED_IDLE", -1)   # the caller kept its priority
    w.close()
    ex.close()


def test_chunks_slower_than_profiled_shrink_what_the_rank_asks_for():
    model = build_model(PRESETS["tiny"]).eval()
    w = BubbleWorker(("127.0.0.1", 1), 0, model, PrefillCost(a=0.0, b=0.001, c=0.0))
    w._learn(measured=0.02, modelled=0.01)          # twice as slow as the profile: rise fast
    assert w.slowdown == 1.5
    assert w._predict({"tokens": [1] * 10, "context": 0}) == 0.015
    for _ in range(200):                            # then as profiled again: fall slowly, never below 1
        w._learn(measured=0.005, modelled=0.01)
    assert w.slowdown == 1.0


def test_a_rank_that_learnt_too_large_a_slowdown_for_its_bubbles_takes_work_again():
    """One very slow chunk (a cold forward, a burst of load) taught the rank a slow-down at which
    no chunk fits its 20 ms bubbles; only a chunk that runs measures it again. The learnt value
    decays while nothing runs, so the rank probes again (it used to stay locked out for good)."""
    model = build_model(PRESETS["tiny"]).eval()
    ex = BubbleExecutor(min_chunk=4)
    fut = ex.submit(3, list(range(1, 13)))
    w = BubbleWorker(ex.address, 0, model, PrefillCost(a=0.0, b=0.0008, c=0.0), secret=ex.secret)
    w.slowdown_half_life_s = 0.1
    w.connect()
    w._learn(measured=0.1, modelled=0.004)          # 25x: under 1 ms of profile fits a bubble, 4 tokens need 3.2
    assert w.slowdown > 10
    deadline = time.time() + 10
    while not fut.done() and time.time() < deadline:
        w.fill(0.02)
        time.sleep(0.01)
    w.close()
    ex.close()
    assert fut.done(), f"no chunk ran in 10 s (learnt slow-down {w.slowdown:.1f})"
    assert fut.result().first_token == prefill(model, list(range(1, 13)))[0]


def test_a_connection_without_the_secret_is_dropped_and_logged_and_joins_no_rank(capfd):
    import socket

    from geotrain.bubbletea.wire import send_frame

    model = build_model(PRESETS["tiny"]).eval()
    ex = BubbleExecutor(min_chunk=1)
    hello = {"rank": 0, "cost": [0.0, 0.0005, 0.0]}
    with socket.create_connection(ex.address) as forged:          # the old protocol: a hello, no proof
        forged.settimeout(5)
        got = b""
        try:
            send_frame(forged, hello)
            send_frame(forged, {"op": "poll", "budget": 1.0})
            while data := forged.recv(1 << 16):                  # until the executor hangs up
                got += data
        except ConnectionResetError:                             # (it may, with our bytes unread)
            pass
        assert b'"op"' not in got, got                           # it never answered the poll
    impostor = BubbleWorker(ex.address, 1, model, PrefillCost(a=0.0, b=0.0005, c=0.0), secret=b"w" * 32)
    try:
        impostor.connect()
        raise AssertionError("a wrong secret was accepted")
    except OSError:
        pass
    deadline = time.time() + 5
    while ex.drops.dropped < 2 and time.time() < deadline:
        time.sleep(0.02)
    assert not ex.ready() and not ex.ranks                        # neither joined as a rank
    w = BubbleWorker(ex.address, 0, model, PrefillCost(a=0.0, b=0.0005, c=0.0), secret=ex.secret)
    w.connect()
    while not ex.ready() and time.time() < deadline:
        time.sleep(0.01)
    assert ex.ready()
    w.close()
    ex.close()
    err = capfd.readouterr().err
    assert err.count("geotrain bubbletea: executor: dropped a connection") == 2, err
    assert "Traceback" not in err


def test_the_executor_out_of_descriptors_backs_off_and_a_rank_still_joins(capfd):
    """Its accept loop returned on any OSError: one EMFILE in the launcher (a flood of HTTP clients)
    and no rank could join after it. Now it logs one line, backs off and accepts again."""
    model = build_model(PRESETS["tiny"]).eval()
    ex = BubbleExecutor()
    client = socket.socket()
    try:
        with descriptors_exhausted():
            client.connect(tuple(ex.address))        # a connection queued: accept() meets EMFILE
            time.sleep(1.0)
    finally:
        client.close()
    fut = ex.submit(1, list(range(1, 9)))
    w = BubbleWorker(ex.address, 0, model, PrefillCost(a=0.0, b=0.0001, c=0.0), secret=ex.secret)
    try:
        w.connect()                                  # accepting again: the rank joins and prefills
        deadline = time.time() + 20
        while not fut.done() and time.time() < deadline:
            w.fill(0.5)
        assert fut.result(timeout=1).first_token == prefill(model, list(range(1, 9)))[0]
    finally:
        w.close()
        ex.close()
    err = capfd.readouterr().err
    assert "executor: cannot accept a connection (Too many open files); backing off" in err, err
    assert "Traceback" not in err


def test_an_opener_dripping_its_hello_is_dropped_at_the_handshake_deadline(capfd, monkeypatch):
    """The executor's handshake timed each recv, so a byte every few seconds held a thread (and a
    descriptor) for minutes, as many as were opened. Now it admits through transport.admission's
    Gate: a deadline bytes do not extend, and a per-address cap."""
    monkeypatch.setenv("GEOTRAIN_HANDSHAKE_TIMEOUT_S", "1")
    ex = BubbleExecutor()
    drip = socket.create_connection(tuple(ex.address))
    t0 = time.monotonic()
    try:
        took = drip_until_closed(drip)
        assert took < 3, took
        while not ex.drops.dropped and time.monotonic() - t0 < 10:
            time.sleep(0.02)
    finally:
        drip.close()
        ex.close()
    err = capfd.readouterr().err
    assert "executor: dropped a connection from 127.0.0.1:" in err and "not finished within 1 s" in err, err
