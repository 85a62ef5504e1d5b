"""Compute that behaves like a GPU (costs.roofline): a micro-batch of 1 costs more per sample than
one of 4, tp = 4 is less than 4x faster than tp = 1 and gains less at small micro-batches -- as
the published per-layer profiles (bench/data/gpu_runs, Sailor's OPT-350 and GPT-Neo-2.7 on A100-40
and GH200) measure -- and the roofline stays near those published points (the regression table:
calibrate.roofline_fit)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from geotrain.calibrate.gpu_runs import load_gpu_runs
from geotrain.calibrate.roofline_fit import fit_rows, score_passes_left
from geotrain.costs import CostModel
from geotrain.models.presets import PRESETS
from geotrain.spec.cluster import BUILTIN_GPU_TYPES, Datacenter

DATA = Path(__file__).resolve().parents[1] / "bench" / "data" / "gpu_runs"
A100 = BUILTIN_GPU_TYPES["a100-40g"]
NODE = Datacenter(name="node", gpu_type="a100-40g", gpus=8, gpus_per_node=8)


@pytest.fixture(scope="module")
def rows():
    return {(r.model, r.gpu, r.micro_batch, r.tp): r for r in fit_rows(load_gpu_runs(DATA))}


def _block_s(cost: CostModel, mb: int, tp: int) -> float:
    t = cost.stage_times([1], A100, mb, tp)
    return t.forward + t.backward + cost.tp_comm_time([1], mb, tp, NODE)


@pytest.mark.parametrize("preset", ["small", "llama2-7b"])
def test_micro_batch_and_tp_are_not_linear(preset):
    cost = CostModel(PRESETS[preset])
    per_sample = {mb: _block_s(cost, mb, 1) / mb for mb in (1, 4)}
    assert per_sample[1] > 1.01 * per_sample[4]                  # a micro-batch of 1 is dearer per sample
    for mb in (1, 4):
        assert _block_s(cost, mb, 1) / _block_s(cost, mb, 4) < 3.9   # tp 4 < 4x tp 1
    assert _block_s(cost, 1, 1) / _block_s(cost, 1, 4) < _block_s(cost, 4, 1) / _block_s(cost, 4, 4)


def test_a_linear_gpu_type_stays_linear():
    """roofline = false (the CPU emulation target): FLOPs / achieved FLOP/s, a micro-batch of 4
    exactly 4x one of 1 (its times come from a measured profile)."""
    cpu = BUILTIN_GPU_TYPES["cpu"]
    cost = CostModel(PRESETS["tiny"])
    one, four = cost.stage_times([1], cpu, 1), cost.stage_times([1], cpu, 4)
    assert four.forward == pytest.approx(4 * one.forward) and four.backward == pytest.approx(4 * one.backward)


def test_published_points_fall_off_and_the_roofline_follows(rows):
    """Per (model, GPU): the published per-sample time at micro-batch 1 over 4 (tp 1), and tp 4's
    speed-up at micro-batch 1 and 4; the roofline has the same directions."""
    for model, gpu in {(m, g) for m, g, _, _ in rows}:
        for side in ("published_s", "predicted_s"):
            t = {(mb, tp): getattr(rows[model, gpu, mb, tp], side) for mb in (1, 4) for tp in (1, 4)}
            assert t[1, 1] > t[4, 1] / 4, (model, gpu, side)
            assert t[1, 1] / t[1, 4] < t[4, 1] / t[4, 4] < 3.9, (model, gpu, side)


def test_regression_table(rows):
    """The fit the GPU defaults come from (docs/DECISIONS.md): every profiled point, the median
    error under 10 %, at least 35 of the 65 within 10 %, none off by more than a third."""
    errors = sorted(abs(r.error) for r in rows.values())
    assert len(errors) == 65
    assert errors[len(errors) // 2] <= 0.10
    assert sum(e <= 0.10 for e in errors) >= 35
    assert errors[-1] <= 0.33


def test_one_attention_pass_count_cannot_fit_both_models():
    """Why the regression table stops short of every point within 10 %: OPT-350's materialized
    attention costs more per score element than GPT-Neo-2.7's in the published profiles. A pass
    count shared by both models needs a GEMM plateau beyond the peak on both GPUs (A100 ~4x: even
    at TF32's peak GPT-Neo leaves ~27 passes over its scores where OPT needs ~36)."""
    needed = {line.split(":")[0]: float(re.search(r"plateau of ([0-9.]+)", line).group(1))
              for line in score_passes_left(load_gpu_runs(DATA)) if "one count" in line}
    assert set(needed) == {"A100-40", "GH-96"}
    assert needed["A100-40"] > 3 and needed["GH-96"] > 1, needed
