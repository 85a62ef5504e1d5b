"""One truth for static memory and DP traffic: what each rank holds and reduces is what the cost model counts.

Four ranks (pp=2 x dp=2, the tiny 2-DC plan) train 2 steps under every sharding in bf16 and fp32 (and
fp16 with zero2, whose FSDP2 reduce-scatter must run in fp16 as replicated DP's all-reduce does),
through the runtime's own worker with torch.distributed's collectives counted
(`_count_collectives.py`). Per rank:
  * the bytes its DP gradient reduction moves per step (all-reduce buffers, or FSDP2's
    reduce-scatter inputs) equal `CostModel.grad_bytes` -- gradients reduced in the training dtype;
  * the parameter and optimizer-state bytes at the first optimizer step (summary.json) equal the
    memory model's (`costs.memory.runtime_state_bytes_per_param` x the stage's parameters), and the
    gradients the optimizer reads are fp32 and sharded as `sharded_fractions` says (the memory
    model's peak counts them unsharded: FSDP2 accumulates them so until the reduction).
ZeRO-1's optimizer partitions whole tensors over the ranks, so its state is P*8/dp only to within
the largest tensor; ZeRO-1's parameter broadcast after the step is not a gradient reduction and is
not counted here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cases import case

from geotrain.costs.cost_model import CostModel
from geotrain.costs.memory import runtime_state_bytes_per_param, sharded_fractions
from geotrain.models.llama import build_units
from geotrain.planner.manual import plan_from_job
from geotrain.runtime.train_config import RunCase
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"
STEPS = 2
CASES = [(p, s) for p in ("bf16", "fp32") for s in ("replicate", "zero1", "zero2", "zero3")]
CASES += [("fp16", "zero2")]   # one fp16 case: its reduce dtype (zero3 takes the same policy)


def tied_spec(tmp: Path) -> Path:
    """tiny_2dc with the embedding and head tied (bf16, zero3, pp=2 x dp=2)."""
    text = SPEC.read_text().replace('cluster = "clusters/tiny_2dc.toml"',
                                    f'cluster = "{SPEC.parent / "clusters" / "tiny_2dc.toml"}"')
    path = tmp / "tied.toml"
    path.write_text(text.replace('model = "tiny"', 'model = { preset = "tiny", tie_embeddings = true }'))
    return path


def bytes_cases(tmp: Path) -> list[RunCase]:
    """Every sharding x precision case, then the tied model (conftest's `collective_counts` runs them)."""
    cases = [case(SPEC, out=str(tmp / f"{p}-{s}"), steps=STEPS, data="synthetic", progress=False,
                       checkpoint_every=0, overrides={"precision": p, "sharding": s})
             for p, s in CASES]
    cases.append(case(tied_spec(tmp), out=str(tmp / "tied"), steps=STEPS, data="synthetic",
                           progress=False, checkpoint_every=0))
    return cases


@pytest.fixture(scope="module")
def measured(collective_counts):
    tmp, counts = collective_counts
    return tmp, counts["bytes"]


@pytest.mark.parametrize("precision,sharding", CASES)
def test_state_and_reduction_bytes_equal_the_cost_model(measured, precision, sharding):
    tmp, counts = measured
    spec = load_spec(SPEC)
    plan = plan_from_job(spec).with_(precision=precision, sharding=sharding)
    cost = CostModel(spec.model, precision=precision, checkpointing=plan.checkpointing, optimizer=spec.job.optimizer)
    per_param = runtime_state_bytes_per_param(precision, spec.job.optimizer, sharding, plan.dp)
    _, grad_share, _ = sharded_fractions(sharding, plan.dp)
    summary = json.loads((tmp / f"{precision}-{sharding}" / "summary.json").read_text())
    for rank in range(plan.num_ranks):
        stage = plan.coords(rank)[0]
        units = [u for a, b in plan.stages[stage].chunks for u in range(a, b)]
        P = cost.stage_params(units)
        got = summary["memory_per_rank"][rank]
        assert got["params"] == P * per_param["params"], (rank, got)
        assert got["grads"] == P * 4 * grad_share, (rank, got)
        if sharding == "zero1":   # whole tensors per rank: within the largest tensor of the stage
            biggest = max(p.numel() for u in units for p in build_units(spec.model, u, u + 1).parameters())
            assert abs(got["optimizer"] - P * per_param["optimizer"]) <= 8 * biggest, (rank, got)
        else:
            assert got["optimizer"] == P * per_param["optimizer"], (rank, got)
        reduced = counts[rank][CASES.index((precision, sharding))]["reduce_bytes"] / STEPS
        assert reduced == cost.grad_bytes(units), (rank, reduced, cost.grad_bytes(units))


def test_tied_embedding_sum_bytes_equal_the_cost_model(measured):
    """A tied model's first and last stage also all-reduce their copies' gradients with each
    other (runtime.tied): what each rank reduces is its DP gradients plus `tied_grad_bytes`, the
    bytes the simulator and planner price that sum on (costs.comm.tied_sum_time)."""
    tmp, counts = measured
    spec = load_spec(tied_spec(tmp))
    plan = plan_from_job(spec)
    cost = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing,
                     optimizer=spec.job.optimizer)
    for rank in range(plan.num_ranks):
        units = [u for a, b in plan.stages[plan.coords(rank)[0]].chunks for u in range(a, b)]
        reduced = counts[rank][len(CASES)]["reduce_bytes"] / STEPS
        assert reduced == cost.grad_bytes(units) + cost.tied_grad_bytes(plan.sharding, plan.dp), (rank, reduced)
