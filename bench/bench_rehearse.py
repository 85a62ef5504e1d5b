"""Benchmark: `geotrain rehearse` (one torchrun per emulated datacenter) beside the built-in launcher
for the same plan, and 1 vs K connections and temporal vs fair sharing under rehearse; with
`--sharing`, temporal vs fair for d = 2, 4, 8 pipelines on one saturated emulated link instead.

    sudo .venv/bin/python bench/bench_rehearse.py [--spec examples/tiny_2dc.toml] [--steps 8]
         [--warmup 2] [--rounds 2] [--wan-rate-scale 0.002]
    sudo .venv/bin/python bench/bench_rehearse.py --sharing [--rounds 5]

Root only (rehearse needs network namespaces). One plan -- the planner's layout for SPEC, its
links given the connections that fill them and temporal sharing -- and three variants of it, each
written as a plan file and trained through the CLI, alternated within each round so drift in the
machine's load hits them alike; the planner's own choice of sharing for the links as run (rates x
--wan-rate-scale) is printed beside them:
  * builtin      -- `geotrain train PLAN --wan auto` (the built-in launcher over the kernel WAN);
  * rehearse     -- `geotrain rehearse PLAN` (same plan, one torchrun per DC);
  * rehearse-c1  -- the plan with 1 connection per link;
  * rehearse-fair -- the plan with fair instead of temporal sharing.
Measured: the median step time (the reporting rank's `step_time_s`) of the steps after `warmup`,
pooled over rounds; for the rehearsals also the connections per pair counted in the kernel and
the turns per iteration the transport recorded (rehearse.json). The WAN is slowed by
--wan-rate-scale (default 0.002: tiny_2dc's 1 Gbit/s link becomes 2 Mbit/s, 0.5 per connection)
so the tiny model's 16 KiB boundary tensors take long enough for the mechanisms to show above the
noise of 4 ranks sharing 2 loaded cores (at 0.01 two runs disagreed by 50 %).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _plans(spec_path: Path, out: Path) -> dict[str, Path]:
    from geotrain.layout.plan import save_plan
    from geotrain.planner.confirm import make_plan
    from geotrain.planner.sharing import apply_temporal, with_connections
    from geotrain.spec import load_spec

    spec = load_spec(spec_path)
    plan = make_plan(spec).plan
    if not plan.links or plan.dp < 2:
        sys.exit(f"{spec_path}: the plan must send over a WAN link with dp >= 2 to compare variants")
    fill = [spec.cluster.link(lp.src_dc, lp.dst_dc).connections_to_saturate() for lp in plan.links]
    if min(fill) < 2:
        sys.exit(f"{spec_path}: one connection fills the link: nothing to compare 1 vs K connections with")
    boundary = plan.micro_batch * spec.model.seq_len * spec.model.hidden * 2      # bf16: only names the stagger
    plan = apply_temporal(with_connections(plan, fill), spec.cluster, boundary, 0.0)
    variants = {"rehearse": plan,
                "rehearse-c1": plan.with_(links=tuple(replace(lp, connections=1) for lp in plan.links)),
                "rehearse-fair": plan.with_(links=tuple(replace(lp, sharing="fair") for lp in plan.links))}
    paths = {}
    for name, p in variants.items():
        paths[name] = out / f"{name}.json"
        save_plan(paths[name], p, spec=spec)
    return paths


def _planner_sharing(spec_path: Path, scale: float) -> str:
    """What the planner picks for SPEC's links at the rates they run at (x scale), and its simulated times."""
    import dataclasses

    from geotrain.planner.confirm import make_plan
    from geotrain.spec import load_spec

    spec = load_spec(spec_path)
    links = [ln.model_copy(update={"capacity_gbps": ln.capacity_gbps * scale,
                                   "per_connection_gbps": ln.per_connection_gbps * scale})
             for ln in spec.cluster.wan_links]
    res = make_plan(dataclasses.replace(spec, cluster=spec.cluster.model_copy(update={"wan_links": links})))
    sims = "; ".join(f"{p.name} ({'/'.join(sorted({lp.sharing for lp in p.links})) or '-'}) {t:.3f} s"
                     for p, t in res.simulated if p.links)
    return f"{'/'.join(sorted({lp.sharing for lp in res.plan.links}))} (simulated: {sims})"


def _grant_round_trip(n: int = 300) -> str:
    """An uncontended turn's cost: RemoteTurns acquire (TCP, authenticated) to an arbiter on loopback."""
    import secrets

    from geotrain.transport.turns import RemoteTurns, TurnArbiter

    secret = secrets.token_bytes(32)
    arbiter = TurnArbiter([0, 1])
    host, port = arbiter.serve(secret=secret)
    client = RemoteTurns(host, port, 0, secret=secret)
    times = []
    for _ in range(n + 1):
        t = time.perf_counter()
        client.acquire()
        times.append(time.perf_counter() - t)
        client.release()
        time.sleep(0.002)
    client.close()
    arbiter.close()
    times = sorted(times[1:])
    return f"median {times[n // 2] * 1e3:.2f} ms, p90 {times[n * 9 // 10] * 1e3:.2f} ms over {n}"


def _sharing_table(rounds: int) -> None:
    """Temporal vs fair for d = 2, 4, 8 pipelines on one saturated emulated link (the cases of
    tests/test_temporal_emulated.py, `calibrate.link_sharing`), measured and simulated."""
    import statistics

    from geotrain.calibrate.link_sharing import PipelineCase, link_cluster, measure, simulated

    cap, conns = 0.01, 4
    cluster = link_cluster(cap, cap / conns, 10.0)
    cases = [PipelineCase(d, 3, 0.025, 0.05, 131072 // d, conns) for d in (2, 4, 8)]
    load0, t0 = os.getloadavg()[0], time.time()
    rows = {(r["case"].d, r["sharing"]): r for r in measure(cases, cluster, rounds=rounds)}
    print(f"10 Mbit/s link ({conns} connections of 2.5 Mbit/s), 10 ms one-way, 1F1B pp=2 x 3 micro-batches, "
          f"compute 25 + 50 ms (slept), 128 KiB / d per transfer; {rounds} rounds; load average {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, {time.time() - t0:.0f} s")
    print(f"turn grant round trip (RemoteTurns to an arbiter on loopback, uncontended): {_grant_round_trip()}")
    print("| d | fair (s) | temporal (s) | temporal / fair | simulated fair / temporal (s) | simulated ratio "
          "| turn wait / held, median (ms) | full-rate transfer (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in cases:
        f, t = rows[(c.d, "fair")], rows[(c.d, "temporal")]
        sf, st = simulated(c, "fair", cluster), simulated(c, "temporal", cluster)
        spread = lambda r: f"{r['iteration_s']:.3f} ({min(r['iterations']):.3f}-{max(r['iterations']):.3f})"  # noqa: E731
        print(f"| {c.d} | {spread(f)} | {spread(t)} | {t['iteration_s'] / f['iteration_s']:.2f} | {sf:.3f} / {st:.3f} "
              f"| {st / sf:.2f} | {statistics.median(t['turn_wait_s']) * 1e3:.1f} / "
              f"{statistics.median(t['turn_held_s']) * 1e3:.1f} | {c.nbytes / (cap * 1e9 / 8) * 1e3:.1f} |")


def _steps(run: Path, warmup: int) -> list[float]:
    rows = [json.loads(x) for x in (run / "losses.jsonl").read_text().splitlines() if x.strip()]
    return [r["step_time_s"] for r in rows[warmup:]]


def _run(argv: list[str], log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "geotrain.cli", *argv], env=env, capture_output=True, text=True)
    log.write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        sys.exit(f"failed ({log}): {(r.stderr.strip().splitlines() or ['?'])[-1]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(ROOT / "examples" / "tiny_2dc.toml"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--wan-rate-scale", type=float, default=0.002)
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--sharing", action="store_true",
                    help="temporal vs fair for d = 2, 4, 8 pipelines on one saturated emulated link instead")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_rehearse needs root (rehearse runs each datacenter in a network namespace)")
    sys.path.insert(0, str(ROOT / "src"))
    if args.sharing:
        _sharing_table(args.rounds)
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-rehearse-"))
    out.mkdir(parents=True, exist_ok=True)
    plans = _plans(Path(args.spec), out)
    common = ["--steps", str(args.steps), "--data", "synthetic", "--wan-rate-scale", str(args.wan_rate_scale)]
    load0, t0 = os.getloadavg()[0], time.time()
    steps: dict[str, list[float]] = {k: [] for k in ("builtin", *plans)}
    measured: dict[str, dict] = {}
    for rnd in range(args.rounds):
        for name in ("builtin", *plans):
            run = out / f"r{rnd}-{name}"
            if name == "builtin":
                _run(["train", str(plans["rehearse"]), "--wan", "auto", "--out", str(run), "--no-progress",
                      "--checkpoint-every", "0", *common], out / f"r{rnd}-{name}.log")
            else:
                _run(["rehearse", str(plans[name]), "--no-compare", "--out", str(run), *common],
                     out / f"r{rnd}-{name}.log")
                measured[name] = json.loads((run / "rehearse.json").read_text())
            steps[name] += _steps(run, args.warmup)
            print(f"round {rnd + 1}/{args.rounds} {name}: median step {statistics.median(steps[name]):.3f} s",
                  flush=True)
    med = {k: statistics.median(v) for k, v in steps.items()}
    print(f"\n{args.spec}, {args.steps} steps ({args.warmup} warm-up left out) x {args.rounds} round(s), "
          f"WAN rates x{args.wan_rate_scale:g}; load average {load0:.1f} -> {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores, {time.time() - t0:.0f} s")
    print("| variant | median step (s) | connections per pair (plan / kernel) | sharing | turns per iteration |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("builtin", *plans):
        links = measured.get(name, {}).get("links", [])
        conns = "; ".join(f"{x['link']} {x['plan_connections']} / "
                          + ",".join(f"{c:g}" for c in sorted(set(x["measured_connections_per_pair"]))) for x in links)
        sharing = ", ".join(sorted({x["sharing"] for x in links})) or "(plan's)"
        turns = "; ".join(f"{x['link']} {x['turns_per_iteration']:g}" for x in links) or "-"
        print(f"| {name} | {med[name]:.3f} | {conns or '-'} | {sharing} | {turns} |")
    print(f"\nthe planner's sharing for these links at x{args.wan_rate_scale:g}: "
          f"{_planner_sharing(Path(args.spec), args.wan_rate_scale)}")
    print(f"\nratios: rehearse / builtin {med['rehearse'] / med['builtin']:.2f}; "
          f"1 / K connections (rehearse) {med['rehearse-c1'] / med['rehearse']:.2f}; "
          f"fair / temporal (rehearse) {med['rehearse-fair'] / med['rehearse']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
