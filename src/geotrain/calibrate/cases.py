"""The validation set: small plans of the tiny model, each run for real and simulated.

Each case is a two-DC cluster ("east", "west") written as TOML into its run directory (the
runtime loads its spec from a file), a plan pinned by the case (stages split evenly, the first
half of the stages in east), and WAN settings that the runtime's WAN path applies (wanrun.py).
The set spans latency (2-40 ms), bandwidth per connection (5-200 Mbit/s), schedule kinds,
pp x dp shapes (2x1, 2x2, 4x1), fair and temporal sharing, and 1 vs 4 connections.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from geotrain.calibrate.calibrated_costs import predict
from geotrain.calibrate.case_rows import bubble_per_rank, compare_case, drop_warmup, measured_metrics
from geotrain.calibrate.profile_file import MeasuredProfile
from geotrain.calibrate.replay import replay_run
from geotrain.calibrate.timers import time_unit
from geotrain.calibrate.wanrun import DEFAULT_MODE, run_plan
from geotrain.costs import CostModel
from geotrain.errors import GeotrainError
from geotrain.layout.plan import LinkPlan
from geotrain.planner.manual import plan_from_job
from geotrain.planner.sharing import apply_temporal
from geotrain.planner.variants import wan_warmup_for
from geotrain.spec.load import load_spec
from geotrain.trace.metrics import compute_ratio
from geotrain.trace.schema import Trace


@dataclass(frozen=True)
class Case:
    name: str
    pp: int = 2
    dp: int = 1
    schedule: str = "1f1b"
    num_microbatches: int = 4
    micro_batch: int = 2
    latency_ms: float = 10.0
    per_connection_mbps: float = 50.0
    capacity_mbps: float = 1000.0
    connections: int = 1
    sharing: str = "fair"
    checkpointing: str = "none"

    @property
    def description(self) -> str:
        return (f"pp{self.pp}x dp{self.dp}, {self.schedule}, m={self.num_microbatches}, {self.latency_ms:g} ms, "
                f"{self.per_connection_mbps:g} Mb/s x{self.connections} conn, {self.sharing}"
                + ("" if self.checkpointing == "none" else f", checkpointing {self.checkpointing}"))


CASES: list[Case] = [
    Case("base", latency_ms=10, per_connection_mbps=50),
    Case("low-latency", latency_ms=2, per_connection_mbps=200),
    Case("high-latency", latency_ms=40, per_connection_mbps=50),
    Case("narrow", latency_ms=10, per_connection_mbps=5),
    Case("narrow-4conn", latency_ms=10, per_connection_mbps=5, connections=4),
    Case("gpipe", schedule="gpipe", latency_ms=20, per_connection_mbps=20),
    Case("zb-h1", schedule="zb-h1", latency_ms=10, per_connection_mbps=50),
    Case("wan-1f1b", schedule="wan-1f1b", latency_ms=40, per_connection_mbps=20),
    Case("dp2-fair", dp=2, latency_ms=10, per_connection_mbps=10),
    Case("dp2-temporal", dp=2, latency_ms=10, per_connection_mbps=10, sharing="temporal"),
    Case("pp4", pp=4, num_microbatches=4, latency_ms=10, per_connection_mbps=20),
]
QUICK = ["base", "narrow-4conn", "dp2-temporal", "pp4"]


def cluster_toml(case: Case) -> str:
    gpus = max(1, case.pp // 2) * case.dp
    dcs = "".join(f'''
[[datacenters]]
name = "{n}"
gpu_type = "cpu"
gpus = {gpus}
gpus_per_node = {gpus}
intra_node_gbps = 40
intra_dc_gbps = 40
intra_dc_latency_us = 50
''' for n in ("east", "west"))
    return f'''name = "validate-{case.name}"
{dcs}
[[wan_links]]
between = ["east", "west"]
latency_ms = {case.latency_ms}
capacity_gbps = {case.capacity_mbps / 1000}
per_connection_gbps = {case.per_connection_mbps / 1000}
max_connections = 8
'''


def spec_toml(case: Case) -> str:
    return f'''name = "validate-{case.name}"
cluster = "cluster.toml"
model = "tiny"

[job]
global_batch = {case.dp * case.micro_batch * case.num_microbatches}
micro_batch = {case.micro_batch}
precision = "bf16"
checkpointing = "{case.checkpointing}"
sharding = "replicate"
schedule = "{case.schedule}"
pp = {case.pp}
dp = {case.dp}
steps = 10
'''


def write_spec(case: Case, directory: Path):
    """Write the case's cluster and experiment TOML into `directory`; returns the loaded Spec."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cluster.toml").write_text(cluster_toml(case))
    path = directory / "spec.toml"
    path.write_text(spec_toml(case))
    return load_spec(path)


def case_plan(spec, case: Case):
    """The plan the case pins: the job's layout with its WAN link settings, as the planner writes them
    (temporal sharing through planner.sharing.apply_temporal: the DP pipelines' order, the turn's
    stagger and the planner's pipeline offsets; wan-1f1b with the extra warm-up the report computes)."""
    plan = plan_from_job(spec)
    link = LinkPlan(src_dc="east", dst_dc="west", connections=case.connections, sharing="fair")
    plan = plan.with_(links=(link,), name=f"validate-{case.name}", pipeline_offsets=())
    if case.sharing == "temporal":
        boundary = CostModel(spec.model, precision=plan.precision).boundary_bytes(plan.micro_batch)
        plan = apply_temporal(plan, spec.cluster, boundary, period=0.0)
    if case.schedule == "wan-1f1b":
        base = plan.with_(schedule="1f1b")
        plan = plan.with_(extra_warmup=wan_warmup_for(spec, base))
    return plan


def unit_speed(spec, profile: MeasuredProfile | dict, micro_batch: int, precision: str) -> float | None:
    """Diagnostic only, never an input of any prediction: one transformer block's forward + backward
    timed now, as the profile timed it (one thread, 10th percentile), over the profile's time -- above
    1 the machine computes slower than when it was profiled (runs minutes apart differed 30-45 % at
    the same sampled load). None when the profile has no such entry."""
    ref = MeasuredProfile.of(profile).block.get(str(micro_batch))
    if not ref or sum(ref) <= 0:
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fwd, bwd = time_unit(spec.model, 1, micro_batch, precision, repeats=20)
    finally:
        torch.set_num_threads(threads)
    return (fwd + bwd) / sum(ref)


def run_case(case: Case, profile: MeasuredProfile | dict, directory: Path, steps: int = 6, warmup: int = 2,
             mode: str | None = None):
    """Predict `case` from the profile alone, then run it for real (steps iterations, the first
    `warmup` discarded) over the runtime's WAN `mode` (default: wanrun.DEFAULT_MODE) and compare.
    Returns (CaseRow, details).

    The prediction is written (predicted_trace.jsonl, `predicted_at`) before the run starts and
    uses nothing the run measures: CPU sharing is the processor-sharing model at the background the
    profile's calibration run had. details["posthoc_iteration_s"] is a second prediction made after
    the run with each stage's compute scaled by its ranks' measured slow-down -- how much of the
    error the machine's load during the run explains, never the headline."""
    if steps <= warmup:
        raise ValueError(f"steps ({steps}) must exceed warm-up ({warmup})")
    directory = Path(directory)
    spec = write_spec(case, directory)
    plan = case_plan(spec, case)
    mode = mode or DEFAULT_MODE
    sim, details = predict(spec, plan, profile, iterations=steps - warmup, mode=mode)
    sim.trace.write_jsonl(directory / "predicted_trace.jsonl")
    predicted_at = time.time()
    speed = unit_speed(spec, profile, plan.micro_batch, plan.precision)   # after the prediction: diagnosis only
    retried = None
    try:
        trace_path, cond = run_plan(spec, plan, directory / "run", steps=steps, mode=mode, warmup=warmup)
    except GeotrainError as e:
        # Once, and on the record: a run that fails (seen: a rank's final gloo barrier losing its peer
        # after training finished, pp4) says nothing about the simulator.
        retried = str(e)
        trace_path, cond = run_plan(spec, plan, directory / "run", steps=steps, mode=mode, warmup=warmup)
    measured = Trace.read_jsonl(trace_path)
    tokens = plan.global_batch * spec.model.seq_len
    mm = measured_metrics(measured, warmup, tokens)
    row = compare_case(case.name, case.description, sim.metrics, mm)
    background, slow = cond["background_runnable"], cond["rank_slowdown"]
    posthoc, _ = predict(spec, plan, profile, iterations=steps - warmup, mode=cond["mode"], rank_slowdown=slow)
    row.posthoc_iteration_s = posthoc.metrics.iteration_time
    # the replay: the run's own compute in the model of everything else -- after the run, not a prediction
    replayed = replay_run(spec, plan, profile, measured, warmup, mode=cond["mode"], rank_slowdown=slow)
    row.replay_iteration_s = replayed.metrics.iteration_time
    row.replay_bubble_rank = bubble_per_rank(replayed.metrics)
    details.update(predicted_at=predicted_at, run_started_after_prediction=True, run_wall_s=cond["wall_s"],
                   background_runnable=background, background_cores_used=cond["background_cores"],
                   steal_cores=cond.get("steal_cores", 0.0), background_sessions=cond.get("background_sessions"),
                   unit_time_vs_profile=speed,
                   wan_mode=cond["mode"], rank_slowdown=slow, retried_after=retried,
                   posthoc_iteration_s=posthoc.metrics.iteration_time,
                   # diagnosis: how much of an error is compute that ran slower or faster than profiled
                   compute_ratio=compute_ratio(sim.trace, drop_warmup(measured, warmup)))
    return row, details
