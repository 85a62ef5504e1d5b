"""BubbleTea for real: training step time with and without prefill in the bubbles.

    .venv/bin/python bench/bench_bubbletea_runtime.py [--spec examples/tiny_2dc.toml] [--steps 30] [--rounds 2]

Runs `geotrain train` alternately without and with `--serve-prefill` (same spec, same steps,
same machine state), a client sending prompts all through the BubbleTea runs. Reports the mean
step time (first steps dropped as warm-up) of each, their ratio, the GPU (here: rank) time the
prefill used, and TTFT percentiles. Ratios are measured side by side: this machine is noisy.

On this 2-core CPU every rank is a process; ranks share cores, so prefill on a waiting rank
can still steal a core from a computing one (on GPUs each rank owns its device).
`--spec examples/tiny_2dc_pp2.toml` (one rank per core) shows the mechanism without most of that
effect; the launcher (HTTP, decode) and the clients still share the machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GEOTRAIN = [sys.executable, "-m", "geotrain"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(port: int, stop: threading.Event, out: list, interval: float) -> None:
    i = 0
    while not stop.is_set():
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            c.request("POST", "/v1/completions", json.dumps({"tokens": [(7 * i + k) % 250 + 1 for k in range(48)],
                                                            "max_new_tokens": 1}))
            r = c.getresponse()
            doc = json.loads(r.read())
            c.close()
            if r.status == 200:
                out.append(doc["ttft_ms"] / 1e3)
            i += 1
        except (OSError, ValueError):
            pass  # not up yet, or shutting down
        stop.wait(interval)


def run(spec: str, steps: int, warmup: int, serve: bool, interval: float, clients: int = 3) -> dict:
    d = tempfile.mkdtemp(prefix="bench-bt-")
    if True:  # the run folder is kept when training fails, for its logs
        argv = GEOTRAIN + ["train", spec, "--steps", str(steps), "--out", d, "--no-progress"]
        ttfts: list[float] = []
        stop = threading.Event()
        th = None
        if serve:
            port = free_port()
            argv += ["--serve-prefill", str(port)]
            th = [threading.Thread(target=client, args=(port, stop, ttfts, interval), daemon=True)
                  for _ in range(clients)]
            for t in th:
                t.start()
        done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            stop.set()
            raise SystemExit(f"geotrain train failed ({done.returncode}): {done.stderr.strip()[-500:]} (run: {d})")
        stop.set()
        for t in th or []:
            t.join(5)
        losses = [json.loads(x) for x in Path(d, "losses.jsonl").read_text().splitlines()]
        times = [x["step_time_s"] for x in losses][warmup:]
        prefill = total = 0.0
        for line in Path(d, "measured_trace.jsonl").read_text().splitlines():
            e = json.loads(line)
            if "header" in e or e["iteration"] <= warmup:
                continue
            if e["kind"] == "prefill":
                prefill += e["end"] - e["start"]
        nranks = len(list(Path(d, "trace").glob("rank*.jsonl"))) or 1
        total = sum(times) * nranks
        shutil.rmtree(d, ignore_errors=True)
        return {"step": float(np.mean(times)), "prefill_frac": prefill / total if total else 0.0, "ttfts": ttfts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="examples/tiny_2dc.toml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between a client's requests")
    ap.add_argument("--clients", type=int, default=3, help="concurrent clients (each waits for its answer)")
    args = ap.parse_args()
    base, bt = [], []
    for r in range(args.rounds):
        for serve in (False, True):
            res = run(args.spec, args.steps, args.warmup, serve, args.interval, args.clients)
            (bt if serve else base).append(res)
            print(f"round {r + 1}: {'with' if serve else 'without'} BubbleTea: step {res['step'] * 1e3:.1f} ms"
                  + (f", prefill {res['prefill_frac']:.1%} of rank time, {len(res['ttfts'])} answered"
                     if serve else ""), flush=True)
    b = float(np.mean([x["step"] for x in base]))
    w = float(np.mean([x["step"] for x in bt]))
    ttfts = np.array([t for x in bt for t in x["ttfts"]] or [0.0])
    print(f"\nspec {args.spec}, {args.steps} steps x {args.rounds} rounds each, alternated")
    print(f"step time without BubbleTea  {b * 1e3:8.1f} ms")
    print(f"step time with BubbleTea     {w * 1e3:8.1f} ms   ratio {w / b:.3f} (target <= 1.03)")
    print(f"rank time used by prefill    {np.mean([x['prefill_frac'] for x in bt]):8.1%}  (utilization gained)")
    print(f"TTFT p50 / p99               {np.percentile(ttfts, 50) * 1e3:.0f} / {np.percentile(ttfts, 99) * 1e3:.0f} ms"
          f"  ({len(ttfts)} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
