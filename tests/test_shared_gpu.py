"""Ranks sharing one GPU (runtime.shared_gpu): the decision on CPU with fake device tables, FSDP2's
collectives through host memory, and a 4-rank run on one (fake) GPU training like the reference."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from _cases import case
from _reference import single_process_losses

from geotrain.errors import GeotrainError
from geotrain.planner.manual import plan_from_job
from geotrain.runtime import host_devices
from geotrain.runtime import shared_gpu as S
from geotrain.runtime.launch import launch, launch_ranks
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"


def _plan(**kw):
    return plan_from_job(load_spec(SPEC)).with_(**kw)


def _keys(world: int, gpus: int, hosts: int = 1) -> list[int]:
    """Device identities as our launcher / torchrun map them: host h runs ranks h*n..., each on local % gpus."""
    per_host = world // hosts
    return [S.key_of(f"h{r // per_host}:{(r % per_host) % gpus}") for r in range(world)]


def test_one_gpu_stages_the_dp_groups_and_the_pipeline():
    plan = _plan()                                   # pp2 x dp2, zero3: ranks 0,1 stage 0; 2,3 stage 1
    for rank in range(4):
        d = S.SharedDevices.of(plan, rank, _keys(4, 1))
        assert d.dp and d.tied          # (used only where the model ties its embeddings)
        assert d.peers == set(range(4)) - {rank}
        assert "host memory" in d.note and "DP groups" in d.note and "pipeline" in d.note


def test_enough_gpus_stage_nothing():
    for rank in range(4):
        d = S.SharedDevices.of(_plan(), rank, _keys(4, 4))
        assert not d.dp and not d.peers and d.note == ""
    assert host_devices.device_problem(_plan(tp=2, dp=1), 4) is None
    # CPU ranks (key 0) share nothing NCCL would see
    assert S.SharedDevices.of(_plan(), 0, [0, 0, 0, 0]).note == ""


def test_two_gpus_for_four_ranks_stage_only_what_shares():
    """Ranks 0,1 (stage 0) on GPUs 0,1 and 2,3 (stage 1) on GPUs 0,1: each DP group is spread over both
    GPUs (NCCL), but each pipeline pair 0-2 and 1-3 shares one GPU (staged)."""
    keys = _keys(4, 2)
    d0 = S.SharedDevices.of(_plan(), 0, keys)
    assert not d0.dp and d0.peers == {2}
    assert "pipeline" in d0.note and "DP groups" not in d0.note
    # the same plan on two hosts of two GPUs: nothing shares
    assert S.SharedDevices.of(_plan(), 0, _keys(4, 2, hosts=2)).note == ""


def test_what_cannot_be_staged_is_refused_in_one_line():
    tp = _plan(dp=1, tp=2, sharding="replicate")
    msg = host_devices.device_problem(tp, 1)
    assert msg is not None and "TP group" in msg and "\n" not in msg and "1 GPU(s)" in msg
    with pytest.raises(GeotrainError, match="TP group"):
        S.SharedDevices.of(tp, 0, _keys(tp.num_ranks, 1))
    z1 = _plan(sharding="zero1")
    assert "ZeRO-1" in host_devices.device_problem(z1, 1)
    assert host_devices.device_problem(z1, 4) is None
    assert host_devices.device_problem(_plan(), 1) is None          # zero3 on one GPU: staged, not refused


def test_the_launcher_refuses_before_any_rank_starts(tmp_path, monkeypatch):
    monkeypatch.setenv(S.FAKE_GPUS_ENV, "1")
    plan = _plan(dp=1, tp=2, sharding="replicate")
    cfg = case(SPEC, out=str(tmp_path / "run"), plan=plan, steps=1, progress=False)
    with pytest.raises(GeotrainError, match="TP group"):
        launch([cfg], plan.num_ranks, tmp_path / "run")
    assert not (tmp_path / "run" / "logs").exists()


def test_fsdp_collectives_go_through_the_staged_comms(tmp_path):
    """Two ranks (gloo): FSDP2's all-gather and reduce-scatter run through StagedAllGather and
    StagedReduceScatter, and the gradients equal one process's on the whole batch."""
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    launch_ranks([sys.executable, str(ROOT / "tests" / "_staged_fsdp_rank.py")], 2, tmp_path, env=env, timeout_s=120,
                 rank0_stdout=False)
    assert "ok True" in (tmp_path / "rank0.log").read_text()


@pytest.mark.slow
@pytest.mark.oldest_torch
def test_four_ranks_on_one_gpu_train_like_one_process(tmp_path):
    """The demo's layout (pp2 x dp2) on one (fake) GPU: FSDP2, the replicated all-reduce, the loss sum and the
    pipeline transfers all staged through host memory -- and the losses are the single-process reference's."""
    spec = load_spec(SPEC)
    cases = {}
    for sharding in ("zero3", "replicate"):
        plan = plan_from_job(spec).with_(precision="fp32", sharding=sharding)
        cases[sharding] = case(SPEC, out=str(tmp_path / sharding), plan=plan, steps=3, data="synthetic",
                               progress=False, checkpoint_every=0)
    os.environ[S.FAKE_GPUS_ENV] = "1"
    try:
        launch(list(cases.values()), 4, tmp_path / "launch", timeout_s=240, env={S.FAKE_GPUS_ENV: "1"})
    finally:
        del os.environ[S.FAKE_GPUS_ENV]
    plan = plan_from_job(spec)
    want = single_process_losses(SPEC, plan.micro_batch, plan.num_microbatches, plan.dp, 3)
    for name in cases:
        got = [json.loads(x)["loss"] for x in (tmp_path / name / "losses.jsonl").read_text().splitlines()]
        assert len(got) == 3 and all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, want)), (name, got, want)
    log = (tmp_path / "launch" / "logs" / "rank0.log").read_text()
    assert "4 ranks share 1 GPU(s)" in log and "through host memory" in log
