"""BubbleTea for real: training step time with and without prefill in the bubbles.

    .venv/bin/python bench/bench_bubbletea_runtime.py [--spec examples/tiny_2dc.toml] [--rounds 3]
        [--priority auto,normal] [--wan auto]

Trains what the README's demo trains -- the plan `geotrain plan SPEC` chooses, over the same WAN
emulation (`--wan auto`: the kernel's where root) -- alternately without and with
`--serve-prefill` (same plan, same steps, same machine state), clients sending prompts all
through the BubbleTea runs. Reports the mean step time (first steps dropped as warm-up) of each,
their ratio, the rank time the prefill used, and TTFT percentiles. Ratios are measured side by
side: this machine is noisy.

On this 2-core CPU every rank is a process and the demo's four ranks share two cores, so a
rank's bubble is not idle hardware: another rank may be computing on the core. `--priority`
lists the BubbleTea arms: `auto`/`idle` runs prefill on a SCHED_IDLE thread (it only takes a
core nobody else wants), `normal` in the rank's own thread (how a GPU rank runs it) -- the
latter shows what sharing cores costs. `--spec examples/tiny_2dc_pp2.toml` gives one rank per core.
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
    """One user sending prompts one after another over a kept-alive connection. Users are on
    other machines; here they share this one, so the thread runs at idle priority to keep its
    CPU out of the measurement. A 503/429 is retried after `interval` at most, not the service's
    Retry-After (1 s): the service answers 503 until a rank joins, and a short run's ranks may
    join and finish within that second -- a quiet CI machine's 3-step run was answered nothing."""
    from geotrain.bubbletea.idle_priority import lower_own_priority

    lower_own_priority()
    i, c = 0, None
    while not stop.is_set():
        try:
            c = c or http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            c.request("POST", "/v1/completions", json.dumps({"prompt": [(7 * i + k) % 250 + 1 for k in range(48)],
                                                            "max_tokens": 1}))
            r = c.getresponse()
            doc = json.loads(r.read())
            if r.status == 200:
                out.append(doc["choices"][0]["ttft_ms"] / 1e3)
            elif r.status in (429, 503):
                stop.wait(min(float(r.getheader("Retry-After", "1")), interval))
            i += 1
        except (OSError, ValueError, http.client.HTTPException):
            if c is not None:
                c.close()
            c = None  # not up yet, or shutting down
        stop.wait(interval)
    if c is not None:
        c.close()


def run(plan: str, steps: int, warmup: int, priority: str | None, interval: float, clients: int, wan: str,
        duty: int = 0) -> dict:
    """One training run; priority None: without BubbleTea."""
    serve = priority is not None
    d = tempfile.mkdtemp(prefix="bench-bt-")
    argv = GEOTRAIN + ["train", plan, "--steps", str(steps), "--out", d, "--no-progress", "--wan", wan]
    ttfts: list[float] = []
    stop = threading.Event()
    th = None
    if serve:
        port = free_port()
        argv += ["--serve-prefill", str(port), "--prefill-priority", priority, "--prefill-duty", str(duty)]
        th = [threading.Thread(target=client, args=(port, stop, ttfts, interval), daemon=True)
              for _ in range(clients)]
        for t in th:
            t.start()
    try:
        done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        stop.set()
        for t in th or []:
            t.join(5)
        if done.returncode:       # the one-line error names the failing rank and its exception
            raise SystemExit(f"geotrain train failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        return _measure(d, warmup, ttfts)
    finally:
        stop.set()
        shutil.rmtree(d, ignore_errors=True)      # also when training failed: no bench-bt-* left behind


def _measure(d: str, warmup: int, ttfts: list[float]) -> dict:
    """Step times, prefill share and TTFTs of one finished run in directory `d`."""
    losses = [json.loads(x) for x in Path(d, "losses.jsonl").read_text().splitlines()]
    times = [x["step_time_s"] for x in losses][warmup:]
    on = [x["step_time_s"] for x in losses[warmup:] if x.get("prefill")]
    off = [x["step_time_s"] for x in losses[warmup:] if x.get("prefill") is False]
    prefill = 0.0
    for line in Path(d, "measured_trace.jsonl").read_text().splitlines():
        e = json.loads(line)
        if "header" in e or e["iteration"] <= warmup:
            continue
        if e["kind"] == "prefill":
            prefill += e["end"] - e["start"]
    nranks = len(list(Path(d, "trace").glob("rank*.jsonl"))) or 1
    total = sum(times) * nranks
    return {"step": float(np.mean(times)), "prefill_frac": prefill / total if total else 0.0, "ttfts": ttfts,
            "on": on, "off": off}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="examples/tiny_2dc.toml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between a client's requests")
    ap.add_argument("--clients", type=int, default=3, help="concurrent clients (each waits for its answer)")
    ap.add_argument("--priority", default="auto", help="BubbleTea arms, comma-separated: auto, idle, normal")
    ap.add_argument("--wan", default="auto", choices=["auto", "kernel", "shaper", "off"])
    ap.add_argument("--duty", type=int, default=0, metavar="N",
                    help="also alternate N steps without and N with prefill inside each BubbleTea run "
                         "(`train --prefill-duty`): a side-by-side comparison free of run-to-run noise")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="also write the first BubbleTea arm's ratio, answered prompts and prefill share as JSON "
                         "(scripts/gpu_check.py reads it)")
    args = ap.parse_args()
    arms = [None] + [p.strip() for p in args.priority.split(",") if p.strip()]
    work = tempfile.mkdtemp(prefix="bench-bt-plan-")
    try:
        res = _rounds(args, arms, str(Path(work, "plan.json")))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(args, arms, res)
    return 0


def _rounds(args, arms: list, plan: str) -> dict:
    done = subprocess.run(GEOTRAIN + ["plan", args.spec, "--out", plan], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"geotrain plan failed: {done.stderr.strip()}")
    res: dict = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm in arms:
            x = run(plan, args.steps, args.warmup, arm, args.interval, args.clients, args.wan, args.duty)
            res[arm].append(x)
            name = "without BubbleTea" if arm is None else f"with BubbleTea ({arm})"
            print(f"round {r + 1}: {name:<28} step {x['step'] * 1e3:6.1f} ms"
                  + (f", prefill {x['prefill_frac']:.1%} of rank time, {len(x['ttfts'])} answered"
                     if arm is not None else ""), flush=True)
    return res


def _report(args, arms: list, res: dict) -> None:
    base = float(np.mean([x["step"] for x in res[None]]))
    print(f"\nplan of {args.spec} (as the demo), WAN {args.wan}, {args.steps} steps x {args.rounds} rounds per arm, "
          "alternated")
    print(f"{'arm':<30} {'step ms':>8} {'ratio':>6} {'prefill':>8} {'TTFT p50':>9} {'p99':>7} {'answered':>9}")
    print(f"{'without BubbleTea':<30} {base * 1e3:8.1f} {1:6.3f}")
    for arm in arms[1:]:
        w = float(np.mean([x["step"] for x in res[arm]]))
        ttfts = np.array([t for x in res[arm] for t in x["ttfts"]] or [0.0])
        print(f"{'with BubbleTea (' + arm + ')':<30} {w * 1e3:8.1f} {w / base:6.3f} "
              f"{np.mean([x['prefill_frac'] for x in res[arm]]):8.1%} {np.percentile(ttfts, 50) * 1e3:7.0f}ms "
              f"{np.percentile(ttfts, 99) * 1e3:5.0f}ms {len(ttfts):9d}")
    if args.duty:
        print(f"\nwithin each BubbleTea run, {args.duty} steps without prefill alternating with {args.duty} with it "
              "(the service and its clients busy throughout):")
        for arm in arms[1:]:
            on = [t for x in res[arm] for t in x["on"]]
            off = [t for x in res[arm] for t in x["off"]]
            if on and off:
                print(f"  {arm:<8} steps with prefill {np.mean(on) * 1e3:7.1f} ms, "
                      f"without {np.mean(off) * 1e3:7.1f} ms, ratio {np.mean(on) / np.mean(off):.3f}  "
                      f"({len(on)} / {len(off)} steps)")
    print("target: ratio <= 1.03; prefill = rank time used by prefill (utilization gained)")
    if args.json and len(arms) > 1:
        arm = arms[1]
        Path(args.json).write_text(json.dumps({
            "ratio": float(np.mean([x["step"] for x in res[arm]])) / base, "base_step_s": base,
            "answered": sum(len(x["ttfts"]) for x in res[arm]),
            "prefill_frac": float(np.mean([x["prefill_frac"] for x in res[arm]]))}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
