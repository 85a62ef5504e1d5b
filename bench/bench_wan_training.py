"""Benchmark: real training over the emulated WAN -- 1 connection vs the plan's, temporal vs fair
sharing -- each measured ratio beside the simulator's prediction for the same plan objects.

    sudo .venv/bin/python bench/bench_wan_training.py [--latency-ms 20] [--capacity-gbps 0.16]
         [--rounds 3] [--steps 6] [--wan auto] [--profile PROFILE.json | --no-calibrate]

Set-up: two DCs (east, west), pp=2 x dp=2, one CPU thread per rank, the tiny model at seq 128 with
micro-batches of 16 (512 KB fp32 boundary tensors), so on this 2-core machine a cross-DC transfer
takes about as long as a stage's compute. Link: 20 ms one-way, 160 Mbit/s, a quarter of that per
TCP connection (so the plan needs 4 connections to fill it).

Plans (all from `plan_from_job`, the same objects go to the runtime and the simulator):
  * c1-fair       -- 1 connection per cross-DC transfer;
  * cK-fair       -- the plan's connections (connections_to_saturate = 4), both DP pipelines at once;
  * cK-temporal   -- the same, links shared temporally (planner.sharing.apply_temporal: turn order,
                     stagger = one transfer at full rate, pipeline offsets).
All cases run in ONE launch, alternating c1, cK-fair, cK-temporal for `rounds` rounds, so drift in
the machine's load hits all three alike. Measured: rank 0's step time (the iteration period) of
every step after the first two of each case (connection set-up, TCP slow start, the offset), median.

Predicted: `geotrain.sim.simulate` with the cost model (ratios only: the "cpu" GPU type is a rough
number), and, when the calibration helper's profile-based costs are available
(geotrain.calibrate.calibrated_costs.predict with a measured profile), their iteration times and ratios too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

CLUSTER = """name = "bench-wan-2dc"
[[datacenters]]
name = "east"
gpu_type = "cpu"
gpus = 2
gpus_per_node = 2
intra_node_gbps = 40
intra_dc_gbps = 40
intra_dc_latency_us = 50
[[datacenters]]
name = "west"
gpu_type = "cpu"
gpus = 2
gpus_per_node = 2
intra_node_gbps = 40
intra_dc_gbps = 40
intra_dc_latency_us = 50
[[wan_links]]
between = ["east", "west"]
latency_ms = {latency}
capacity_gbps = {capacity}
per_connection_gbps = {per_conn}
max_connections = 8
"""

EXPERIMENT = """name = "bench-wan-training"
cluster = "cluster.toml"
model = {{preset = "tiny", seq_len = {seq}}}
[job]
global_batch = {gb}
micro_batch = {mb}
precision = "fp32"
checkpointing = "none"
sharding = "replicate"
schedule = "1f1b"
pp = 2
dp = 2
steps = 6
lr = 1e-3
"""


def write_spec(d: Path, a: argparse.Namespace) -> Path:
    (d / "cluster.toml").write_text(CLUSTER.format(latency=a.latency_ms, capacity=a.capacity_gbps,
                                                   per_conn=a.capacity_gbps / 4))
    (d / "exp.toml").write_text(EXPERIMENT.format(seq=a.seq, mb=a.micro_batch, gb=2 * a.micro_batch * a.microbatches))
    return d / "exp.toml"


def make_plans(spec) -> dict:
    from geotrain.costs import CostModel
    from geotrain.planner.manual import plan_from_job
    from geotrain.planner.sharing import apply_fair, apply_temporal, with_connections
    from geotrain.sim import simulate

    base = apply_fair(plan_from_job(spec))
    k = base.links[0].connections
    fair = base.with_(name=f"c{k}-fair")
    one = with_connections(base, [1]).with_(name="c1-fair")
    boundary = CostModel(spec.model, precision=base.precision).boundary_bytes(base.micro_batch)
    period = simulate(spec, fair, iterations=3).metrics.iteration_time
    temporal = apply_temporal(fair, spec.cluster, boundary, period).with_(name=f"c{k}-temporal")
    return {"c1-fair": one, "cK-fair": fair, "cK-temporal": temporal}


def measure(spec, plans: dict, out: Path, rounds: int, steps: int, mode: str) -> tuple[dict, str]:
    from geotrain.runtime.launch import run_with_wan
    from geotrain.runtime.train_config import RunCase, TrainConfig, WanConfig

    cases, where = [], []
    for r in range(rounds):
        for name, plan in plans.items():
            d = out / f"{name}-r{r}"
            cases.append(RunCase(spec, plan, TrainConfig(out=str(d), steps=steps, data="synthetic", progress=False,
                                                         trace=False, checkpoint_every=0, wan=WanConfig(mode=mode))))
            where.append((name, d))
    said = []
    t = time.time()
    wan = run_with_wan(cases, out, say=said.append, timeout_s=1800)
    print(f"# {said[0] if said else 'WAN: none'}\n# {len(cases)} cases in one launch, {time.time() - t:.0f} s",
          flush=True)
    times: dict[str, list[float]] = {n: [] for n in plans}
    for name, d in where:
        rows = [json.loads(x) for x in (d / "losses.jsonl").read_text().splitlines() if x.strip()]
        times[name] += [row["step_time_s"] for row in rows if row["step"] > 2]
    return times, wan.mode


def predictions(spec, plans: dict, profile: dict | None) -> tuple[dict, dict | None]:
    from geotrain.sim import simulate

    plain = {n: simulate(spec, p, iterations=3).metrics.iteration_time for n, p in plans.items()}
    if profile is None:
        return plain, None
    from geotrain.calibrate.calibrated_costs import predict

    calibrated = {n: predict(spec, p, profile)[0].metrics.iteration_time for n, p in plans.items()}
    return plain, calibrated


def load_or_measure_profile(spec, a: argparse.Namespace) -> dict | None:
    if a.no_calibrate:
        return None
    try:
        from geotrain.calibrate.measure import measure_profile
        from geotrain.calibrate.profile_file import load_profile
    except ImportError as e:
        print(f"# calibrated costs unavailable ({e}); ratios from the plain cost model only")
        return None
    if a.profile:
        return load_profile(a.profile)
    print("# measuring a quick calibration profile (geotrain.calibrate, ~1 min) ...", flush=True)
    try:
        return measure_profile(spec, quick=True)
    except Exception as e:  # noqa: BLE001 -- the benchmark still reports measured and plain-model ratios
        print(f"# calibration failed ({type(e).__name__}: {e}); ratios from the plain cost model only")
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--capacity-gbps", type=float, default=0.16, help="link capacity; per connection: a quarter")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step per pipeline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--wan", default="auto", choices=["auto", "kernel", "shaper"])
    ap.add_argument("--profile", default=None, help="calibration profile to reuse (geotrain profile)")
    ap.add_argument("--no-calibrate", action="store_true", help="skip the calibrated prediction")
    a = ap.parse_args(argv)

    from geotrain.spec.load import load_spec

    with tempfile.TemporaryDirectory(prefix="bench-wan-training-") as tmp:
        tmp = Path(tmp)
        spec = load_spec(write_spec(tmp, a))
        plans = make_plans(spec)
        k = plans["cK-fair"].links[0].connections
        tp = plans["cK-temporal"]
        print(f"# {spec.model.name} seq {spec.model.seq_len}, pp=2 x dp=2, micro-batch {a.micro_batch} x "
              f"{a.microbatches}; link {a.latency_ms:g} ms one-way, {a.capacity_gbps * 1e3:g} Mbit/s, "
              f"{a.capacity_gbps * 250:g} Mbit/s per connection; plan: {k} connections; temporal: order "
              f"{list(tp.links[0].order)}, stagger {tp.links[0].stagger_s * 1e3:.1f} ms, offsets "
              f"{[round(x * 1e3, 1) for x in tp.pipeline_offsets]} ms", flush=True)
        profile = load_or_measure_profile(spec, a)
        times, mode = measure(spec, plans, tmp / "runs", a.rounds, a.steps, a.wan)
        plain, calibrated = predictions(spec, plans, profile)
    if mode != "kernel":
        print("# NOTE: user-space shaper: its rate caps are per sending process, so 'fair' DP pipelines do not "
              "slow each other; the temporal-vs-fair ratio is only meaningful with --wan kernel (root)")
    med = {n: statistics.median(v) for n, v in times.items()}
    print(f"\n{'plan':<14}{'steps':>6}{'measured s/it':>15}{'spread (min-max)':>20}{'sim (cost model)':>18}"
          + (f"{'sim (calibrated)':>18}" if calibrated else ""))
    for n, v in times.items():
        row = f"{n:<14}{len(v):>6}{med[n]:>15.3f}{f'{min(v):.3f}-{max(v):.3f}':>20}{plain[n]:>18.3f}"
        print(row + (f"{calibrated[n]:>18.3f}" if calibrated else ""))
    head = f"\n{'ratio':<34}{'measured':>10}{'sim (cost model)':>18}"
    print(head + (f"{'sim (calibrated)':>18}" if calibrated else ""))
    for label, x, y in ((f"1 connection / {k} connections", "c1-fair", "cK-fair"),
                        ("fair / temporal sharing", "cK-fair", "cK-temporal")):
        row = f"{label:<34}{med[x] / med[y]:>10.2f}{plain[x] / plain[y]:>18.2f}"
        print(row + (f"{calibrated[x] / calibrated[y]:>18.2f}" if calibrated else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
