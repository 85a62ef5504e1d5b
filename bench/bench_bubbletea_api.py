"""BubbleTea's OpenAI-compatible API (FastAPI on uvicorn) against the hand-written HTTP layer it
replaced, under the same load: TTFT p50/p99 (client-side, one-token completions, so the latency
is the time to the first token) and requests/s, the two APIs alternated within one run since
this machine is noisy. Both serve the same tiny model through the same dedicated prefill
executor, so the difference is the HTTP layer.

    .venv/bin/python bench/bench_bubbletea_api.py [--clients 8] [--requests 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from geotrain.bubbletea.executor import DecodeWorker, DedicatedExecutor  # noqa: E402
from geotrain.bubbletea.service import PrefillService  # noqa: E402
from geotrain.models.llama import build_model  # noqa: E402
from geotrain.models.presets import PRESETS  # noqa: E402


def _start(api: str, model):
    ex = DedicatedExecutor(model)
    if api == "old":
        import _old_bubbletea_service as old

        svc = old.PrefillService(ex, DecodeWorker(model), max_queue=256, max_new_tokens=4)
    else:
        svc = PrefillService(ex, DecodeWorker(model), max_queue=256, max_new_tokens=4)
    host, port = svc.serve()
    return svc, ex, host, port


def _load(api: str, host: str, port: int, clients: int, requests: int) -> tuple[list[float], float, int]:
    lat: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=120)
        for i in range(requests):
            ids = [(7 * (c * requests + i) + k) % 250 + 1 for k in range(32)]
            body = {"tokens": ids, "max_new_tokens": 1} if api == "old" else {"prompt": ids, "max_tokens": 1}
            t = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            dt = time.perf_counter() - t
            with lock:
                if r.status == 200:
                    lat.append(dt)
                else:
                    errors[0] += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat, time.perf_counter() - t0, errors[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=40, help="per client per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: on a loaded machine, OpenMP teams of 2 run prefill ~10x slower)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    model = build_model(PRESETS["tiny"]).eval()
    res: dict[str, dict[str, list]] = {a: {"lat": [], "rps": [], "err": []} for a in ("old", "new")}
    for rnd in range(args.rounds):
        for api in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
            svc, ex, host, port = _start(api, model)
            _load(api, host, port, 2, 3)                       # warm-up
            lat, wall, err = _load(api, host, port, args.clients, args.requests)
            svc.close()
            ex.close()
            res[api]["lat"] += lat
            res[api]["rps"].append(len(lat) / wall)
            res[api]["err"].append(err)
            print(f"round {rnd + 1} {api}: {len(lat) / wall:7.1f} req/s, p50 {1e3 * statistics.median(lat):6.1f} ms",
                  flush=True)

    def q(v: list[float], p: float) -> float:
        s = sorted(v)
        return s[min(len(s) - 1, int(p * len(s)))]

    print(f"\n{args.clients} clients x {args.requests} one-token completions of 32-token prompts, {args.rounds} rounds")
    print(f"{'API':<34}{'TTFT p50':>10}{'TTFT p99':>10}{'req/s':>9}{'errors':>8}")
    rows = {}
    for api, label in (("old", "old (http.server, bcfd1c6)"), ("new", "new (FastAPI/uvicorn, OpenAI)")):
        r = res[api]
        rows[api] = (q(r["lat"], 0.5), q(r["lat"], 0.99), statistics.mean(r["rps"]))
        print(f"{label:<34}{1e3 * rows[api][0]:>8.1f}ms{1e3 * rows[api][1]:>8.1f}ms{rows[api][2]:>9.1f}"
              f"{sum(r['err']):>8}")
    o, n = rows["old"], rows["new"]
    print(f"{'new / old':<34}{n[0] / o[0]:>10.2f}{n[1] / o[1]:>10.2f}{n[2] / o[2]:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
