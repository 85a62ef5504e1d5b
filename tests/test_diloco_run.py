"""DiLoCo trained for real (runtime.diloco_launch): every worker its own job, the outer exchange
over the striped transport. Tiny model, fp32, CPU ranks, no WAN emulation (the exchange's bytes
over the emulated WAN are bench/bench_cross_dc.py's).

* H = 1 with an outer SGD of lr 1 and momentum 0 trains as synchronous DP over the workers'
  replicas: with plain SGD inside, theta - mean_w(theta - theta_w) is theta - lr mean_w(g_w) up to
  the rounding of the subtractions (~1 ulp), so the parameters agree to 1e-6 relative -- not bit
  for bit: theta - (theta - lr g) is not lr g in floating point. Every worker holds the same
  parameters bit for bit.
* A run resumed from a checkpoint (taken with a fragment's average in flight) ends bit for bit
  where the uninterrupted run ends.
* A worker that dies does not stop the others; with --elastic one whose DC is cut (--cut-dc)
  is restarted and rejoins.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _cases import case
from _reference import reference_with_model
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from geotrain.layout.workers import OuterPlan
from geotrain.orchestrate.local_run import train_locally
from geotrain.planner.manual import plan_from_job
from geotrain.runtime.diloco_launch import run_workers
from geotrain.runtime.train_config import ElasticConfig, RunCase
from geotrain.spec.load import load_spec
from geotrain.trace.schema import Trace

pytestmark = pytest.mark.slow

CLUSTER = """name = "three"
""" + "".join(f"""
[[datacenters]]
name = "{n}"
gpu_type = "cpu"
gpus = 4
gpus_per_node = 4
intra_node_gbps = 40
intra_dc_gbps = 40
intra_dc_latency_us = 50
""" for n in ("a", "b", "c")) + "".join(f"""
[[wan_links]]
between = ["{x}", "{y}"]
latency_ms = 10
capacity_gbps = 1.0
per_connection_gbps = 0.25
""" for x, y in (("a", "b"), ("a", "c"), ("b", "c")))


def _spec(tmp: Path, optimizer: str = "sgd", pp: int = 1, dp: int = 1, dead_after_s: float = 30.0):
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "cluster.toml").write_text(CLUSTER)
    (tmp / "spec.toml").write_text(f"""name = "dl"
cluster = "cluster.toml"
model = "tiny"

[job]
global_batch = {4 * dp}
micro_batch = 2
precision = "fp32"
checkpointing = "none"
sharding = "replicate"
schedule = "1f1b"
optimizer = "{optimizer}"
pp = {pp}
dp = {dp}
steps = 4
lr = 0.05
grad_clip = 0.0

[job.diloco]
dead_after_s = {dead_after_s}
""")
    return load_spec(tmp / "spec.toml")


def _cfg(spec_path: Path, out: Path, plan, steps: int, every: int, **kw) -> RunCase:
    kw.setdefault("trace", False)
    return case(spec_path, out=str(out), plan=plan, data="synthetic", progress=False, steps=steps,
                checkpoint_every=every, **kw)


def _model(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(ckpt, tmp / "state.pt")
    return torch.load(tmp / "state.pt")["model"]


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "losses.jsonl").read_text().splitlines() if x.strip()]


def test_h1_outer_sgd_lr1_momentum0_trains_as_synchronous_dp(tmp_path):
    spec = _spec(tmp_path, pp=1, dp=2)
    base = plan_from_job(spec)
    # two workers of dp 2 (replicated: each replica exchanges half and they all-gather) vs dp 4
    # the two replicas of a worker send over one link: with temporal sharing they take turns there
    plan = base.with_(outer=OuterPlan(workers=(("a",), ("b",)), inner_steps=1, lr=1.0, momentum=0.0,
                                      nesterov=False, connections=4, sharing="temporal"))
    run_workers(_cfg(tmp_path / "spec.toml", tmp_path / "dl", plan, 4, 4, trace=True))
    events = Trace.read_jsonl(tmp_path / "dl" / "measured_trace.jsonl").events
    turns = [e for e in events if e.kind == "turn"]
    assert {e.link for e in turns} == {"a->b"} and {e.rank for e in turns} == {0, 1}
    syncs = [e for e in events if e.kind == "outer_sync"]
    assert len(syncs) == 2 * 4 and {e.link for e in syncs} == {"a->workers"}
    # synchronous DP over the four replicas: the single-process loop over their global batch (which
    # tests/test_runtime_pipeline.py holds the runtime's synchronous DP to), in-process: no launch
    want, _, _, ref = reference_with_model(tmp_path / "spec.toml", base.micro_batch, base.num_microbatches, 4, 4)
    step = "checkpoints/step_00000004"
    w0, w1 = _model(tmp_path / "dl" / step, tmp_path), _model(tmp_path / "dl" / "worker1" / step, tmp_path)
    assert w0.keys() == ref.keys()
    for k in ref:
        assert torch.equal(w0[k], w1[k]), k                   # the workers agree bit for bit
        assert (w0[k] - ref[k]).abs().max() <= 1e-6 * ref[k].abs().max(), k
    # the mean of the workers' losses is the synchronous run's (each worker's replicas see half the batch)
    mean = [(a + b) / 2 for a, b in zip(_losses(tmp_path / "dl"), _losses(tmp_path / "dl" / "worker1"), strict=True)]
    assert mean == pytest.approx(want, rel=1e-6)


def test_a_resumed_diloco_run_ends_where_the_uninterrupted_one_does(tmp_path):
    spec = _spec(tmp_path, optimizer="adamw", pp=2)
    # streaming: 2 fragments, each exchange applied one inner step later, int8 outer gradients;
    # the checkpoint at step 4 holds fragment 1's average (started after step 4, due after step 5)
    o = OuterPlan(workers=(("a", "b"), ("c", "c")), inner_steps=4, fragments=2, overlap=1, compression="int8",
                  connections=2)
    plan = plan_from_job(spec).with_(outer=o)
    sp = tmp_path / "spec.toml"
    run_workers(_cfg(sp, tmp_path / "full", plan, 8, 4))
    _stopped_after_step_4(tmp_path / "full", tmp_path / "part")
    run_workers(_cfg(sp, tmp_path / "part", plan, 8, 4, resume=True))
    for w in ("", "worker1"):
        full, part = tmp_path / "full" / w, tmp_path / "part" / w
        assert not list(part.glob("checkpoints.run*"))           # it resumed (no new series beside the old one)
        assert _losses(part) == _losses(full)
        last = "checkpoints/step_00000008"
        a, b = _model(full / last, tmp_path), _model(part / last, tmp_path)
        assert all(torch.equal(a[k], b[k]) for k in a)



def _stopped_after_step_4(full: Path, part: Path) -> None:
    """`part` as a run killed after its step-4 checkpoint leaves it: the full run's directory up to
    there (its step-4 checkpoint is what that run would have saved; one launch fewer than running it)."""
    shutil.copytree(full, part)
    for ckpts in part.glob("**/checkpoints"):
        shutil.rmtree(ckpts / "step_00000008")
        (ckpts / "latest").write_text("step_00000004")
    for losses in part.glob("**/losses.jsonl"):
        losses.write_text("".join(losses.read_text().splitlines(keepends=True)[:4]))

def test_a_lost_worker_does_not_stop_the_others(tmp_path):
    spec = _spec(tmp_path)
    o = OuterPlan(workers=(("a",), ("b",), ("c",)), inner_steps=2, connections=2)
    plan = plan_from_job(spec).with_(outer=o)
    said: list[str] = []
    # worker 1's only rank fails at the start of step 3: workers 0 and 2 finish all 8 steps
    cfg = _cfg(tmp_path / "spec.toml", tmp_path / "run", plan, 8, 0, fail_at=[[0, 3, 1]])
    wan = run_workers(cfg, say=said.append, dead_after_s=3.0)
    assert list(wan.lost) == [1] and "injected failure at step 3" in wan.lost[1]
    for w in ("", "worker2"):
        assert len(_losses(tmp_path / "run" / w)) == 8
    assert len(_losses(tmp_path / "run" / "worker1")) == 2
    logs = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "outer exchange #1 goes on without worker(s) 1" in logs or "goes on without worker(s) 1" in \
        (tmp_path / "run" / "worker2" / "logs" / "rank0.log").read_text()
    assert any("worker(s) 1 lost; the others finished" in line for line in said)


def test_with_elastic_a_worker_whose_dc_is_cut_rejoins_from_the_others_state(tmp_path, capfd):
    """`train --elastic --cut-dc b:3` (train_locally): worker 1's ranks in DC b are killed once it
    logged step 3; the launcher restarts it and it rejoins after an outer exchange."""
    spec = _spec(tmp_path, optimizer="adamw", dead_after_s=3.0)
    o = OuterPlan(workers=(("a",), ("b",)), inner_steps=4, connections=2)
    plan = plan_from_job(spec).with_(outer=o)
    said: list[str] = []
    steps = 40
    cfg = _cfg(tmp_path / "spec.toml", tmp_path / "run", plan, steps, steps,
               elastic=ElasticConfig(enabled=True, cut_dc="b:3"))
    train_locally(cfg, say=said.append)
    assert any("worker 1 lost" in line and "restarting it to rejoin" in line for line in said), said
    assert not any("lost; the others finished" in line for line in said), said
    rejoined = [json.loads(x)["step"] for x in (tmp_path / "run" / "worker1" / "losses.jsonl").read_text().splitlines()]
    cut = next(i for i in range(1, len(rejoined)) if rejoined[i] != rejoined[i - 1] + 1)   # the first gap
    assert rejoined[:cut] == list(range(1, cut + 1)) and cut >= 3               # killed after step 3 was logged
    assert rejoined[cut:] == list(range(rejoined[cut], steps + 1)) and rejoined[cut] > cut
    assert rejoined[cut] % 4 == 1                                  # it continued right after an outer exchange
    assert "worker 1 rejoined after step" in capfd.readouterr().out      # worker 0's rank 0 prints to ours
    last = f"checkpoints/step_{steps:08d}"
    a, b = _model(tmp_path / "run" / last, tmp_path), _model(tmp_path / "run" / "worker1" / last, tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)                # one model again after the last exchange
