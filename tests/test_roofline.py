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
from geotrain.calibrate.roofline_fit import block_spec, fit_rows, score_passes_left
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


@pytest.mark.parametrize("preset", ["OPT-350", "llama2-7b"])
def test_micro_batch_and_tp_are_not_linear(preset):
    """In the planner's setting (bf16, fused attention). A small model's block at micro-batch 1 is
    host-bound (its kernels queue slower than they run); a 7B block's 4,096 tokens already fill
    the GEMMs, so there micro-batch 1 is only not cheaper."""
    model = block_spec(load_gpu_runs(DATA), preset) if preset == "OPT-350" else PRESETS[preset]
    cost = CostModel(model)
    per_sample = {mb: _block_s(cost, mb, 1) / mb for mb in (1, 4)}
    assert per_sample[1] > (1.01 if preset == "OPT-350" else 1.0) * per_sample[4]
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
    error under 5 %, at least 60 of the 65 within 10 % (the old fit: 35) and all but one within
    11 %; the one is GPT-Neo on GH200 at micro-batch 1, tp 2, which the profile has at 0.91x its
    tp 1 time while micro-batch 2 takes 1.41x it (no smooth model follows that)."""
    errors = sorted(abs(r.error) for r in rows.values())
    assert len(errors) == 65
    assert errors[len(errors) // 2] <= 0.05
    assert sum(e <= 0.10 for e in errors) >= 60
    assert errors[-2] <= 0.11
    worst = max(rows.values(), key=lambda r: abs(r.error))
    assert (worst.model, worst.gpu, worst.micro_batch, worst.tp) == ("GPT-Neo-2.7", "GH-96", 1, 2)
    assert abs(worst.error) <= 0.33


def test_one_attention_pass_count_fits_both_models():
    """The two models' materialized attention is one code path (Sailor's Megatron fork), so one
    count of passes over the scores must fit both at a plateau below the peak: with the GPT-Neo
    runs' 20 heads it does (A100 ~0.76, GH200 ~0.41 of peak); with models.json's 32 it took ~4x
    A100's TF32 peak -- the shape the old fit was made on."""
    needed = {line.split(":")[0]: float(re.search(r"plateau of ([0-9.]+)", line).group(1))
              for line in score_passes_left(load_gpu_runs(DATA)) if "one count" in line}
    assert set(needed) == {"A100-40", "GH-96"}
    assert 0.3 < needed["A100-40"] < 1 and 0.3 < needed["GH-96"] < 1, needed
