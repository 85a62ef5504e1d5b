"""The WAN bytes a plan moves per iteration (layout.wan_bytes), one definition for the egress price,
`plan`/`simulate`'s printed WAN bytes and the report: a region plan's DP sync crosses the WAN
(every reduce-scatter and all-gather its sharding runs), and the printed number is the formula's.
The check against the emulated links' counters is tests/test_region_train.py's (it reuses that
file's region run)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from geotrain.console import human_bytes
from geotrain.costs import CostModel
from geotrain.layout.plan import StagePlan, save_plan
from geotrain.layout.price import wan_bytes_per_link
from geotrain.layout.wan_bytes import (
    LOSS_SUM_BYTES,
    NORM_BYTES,
    OVERFLOW_BYTES,
    pipeline_bytes,
    wan_bytes_per_direction,
)
from geotrain.planner.manual import plan_from_job
from geotrain.sim import simulate
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def _region(sharding: str):
    spec = load_spec(SPEC)
    base = plan_from_job(spec)
    plan = base.with_(stages=tuple(StagePlan(dc="east", chunks=st.chunks) for st in base.stages),
                      replica_dcs=("east", "west"), links=(), name="tiny-region", sharding=sharding)
    return spec, plan


def _by_hand(spec, plan, halves_of_stage) -> float:
    """Per direction: a two-DC ring sends half of each collective's bytes each way."""
    cost = CostModel(spec.model, precision="bf16")
    return sum(0.5 * halves_of_stage(cost, st.units) for st in plan.stages)


@pytest.mark.parametrize("sharding", ["replicate", "zero1", "zero3"])
def test_a_region_plans_dp_sync_is_its_wan_bytes(sharding):
    spec, plan = _region(sharding)
    assert pipeline_bytes(spec, plan) == {}          # each pipeline inside one DC
    if sharding == "replicate":   # an all-reduce of the bf16 gradients: reduce-scatter + all-gather
        want = _by_hand(spec, plan, lambda c, u: 2 * c.grad_bytes(u))
    elif sharding == "zero1":     # that, then ZeroRedundancyOptimizer's broadcast of the fp32 weights
        want = _by_hand(spec, plan, lambda c, u: 2 * c.grad_bytes(u) + 4 * c.stage_params(u))
    else:                         # reduce-scatter + 5 bf16 gathers of the weights
        want = _by_hand(spec, plan, lambda c, u: c.grad_bytes(u) + 5 * 2 * c.stage_params(u))
    want += LOSS_SUM_BYTES        # the loss (one float64) summed over the last stage's replicas, one in each DC
    want += plan.pp * NORM_BYTES  # each stage's all-reduce of its squared gradient norm (clipping on), likewise
    assert wan_bytes_per_direction(spec, plan) == {("east", "west"): want, ("west", "east"): want}
    assert wan_bytes_per_link(spec, plan) == {("east", "west"): 2 * want}     # what egress prices
    assert simulate(spec, plan).metrics.wan_bytes == int(2 * want) > 0          # what plan/simulate print
    # gloo (a CPU run's ranks) runs the reduce-scatter as an all-reduce: one more half of the gradients
    extra = 0 if sharding in ("replicate", "zero1") else _by_hand(spec, plan, lambda c, u: c.grad_bytes(u))
    assert wan_bytes_per_direction(spec, plan, backend="gloo")[("east", "west")] == want + extra


def test_a_pipeline_plans_simulated_transfers_are_its_wan_bytes():
    spec = load_spec(SPEC)
    plan = plan_from_job(spec)
    assert sum(wan_bytes_per_link(spec, plan).values()) == simulate(spec, plan).metrics.wan_bytes > 0


def test_simulate_prints_a_region_plans_wan_bytes(tmp_path):
    spec, plan = _region("zero3")
    save_plan(tmp_path / "region.json", plan, spec=spec)
    r = subprocess.run([sys.executable, "-m", "geotrain.cli", "simulate", str(tmp_path / "region.json"),
                        "--out", str(tmp_path / "sim"), "--no-compare", "--no-progress", "--no-timeline"],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    shown = re.search(r"WAN bytes / iteration\s*\|?\s*([\d.]+ \w+)", r.stdout)
    assert shown, r.stdout
    assert shown.group(1) == human_bytes(sum(wan_bytes_per_link(spec, plan).values())) != "0 B"


def test_a_tied_models_embedding_sum_crosses_between_its_first_and_last_dc():
    """tiny_2dc tied: stage 0 in east, stage 1 in west; each DP replica's pair of copies sums its
    fp32 gradient shard (zero3: 1/dp of the matrix) in a two-rank all-reduce: those bytes each way."""
    import dataclasses

    spec = load_spec(SPEC)
    tied = dataclasses.replace(spec, model=spec.model.model_copy(update={"tie_embeddings": True}))
    plan = plan_from_job(tied)
    shard = CostModel(tied.model, precision="bf16").tied_grad_bytes(plan.sharding, plan.dp)
    assert shard == tied.model.vocab * tied.model.hidden * 4 // plan.dp > 0
    sum_each_way = plan.dp * shard
    untied = wan_bytes_per_direction(spec, plan)
    assert wan_bytes_per_direction(tied, plan) == {k: v + sum_each_way for k, v in untied.items()}
    assert simulate(tied, plan).metrics.wan_bytes == sum(untied.values()) + 2 * sum_each_way


def test_the_steps_control_all_reduces_are_counted():
    """fp16 all-reduces its overflow flag and loss over the whole world every step (east and west here);
    bf16 sums the loss inside the last stage's DP group (both replicas in west: nothing crosses)."""
    spec = load_spec(SPEC)
    plan = plan_from_job(spec)
    unclipped = dataclasses.replace(spec, job=spec.job.model_copy(update={"grad_clip": 0.0}))
    bf16, fp16 = (wan_bytes_per_direction(unclipped, plan.with_(precision=p)) for p in ("bf16", "fp16"))
    assert fp16 == {k: v + OVERFLOW_BYTES for k, v in bf16.items()}        # 2 (k-1)/k b per hop, k = 2
    assert bf16 == pipeline_bytes(spec, plan)
    # Clipping: fp16's all-reduce carries the squared norm too; bf16 sends one float64 per replica over
    # the east-west boundary each way (the partial sum down to stage 0, the total back up).
    bf16, fp16 = (wan_bytes_per_direction(spec, plan.with_(precision=p)) for p in ("bf16", "fp16"))
    assert fp16 == {k: v + OVERFLOW_BYTES + NORM_BYTES for k, v in pipeline_bytes(spec, plan).items()}
    assert bf16 == {k: v + plan.dp * NORM_BYTES for k, v in pipeline_bytes(spec, plan).items()}
