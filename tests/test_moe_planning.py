"""A mixture of experts in the cost model and the planner: FLOPs of the active experts, parameters
and memory of all of them (1/ep per GPU under expert parallelism), the all-to-all time, and the
EP degree searched like tp -- inside a DC, never across the WAN unless pinned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from geotrain.costs import CostModel
from geotrain.costs.experts import all_to_all_time
from geotrain.errors import SpecError
from geotrain.models.llama import build_model, build_units
from geotrain.models.presets import PRESETS
from geotrain.planner.context import ep_options
from geotrain.planner.manual import plan_from_job
from geotrain.planner.scan import tp_groups
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
MOE = PRESETS["tiny-moe"]


def test_moe_parameters_and_flops_count_all_and_active_experts():
    model = build_model(MOE)
    assert sum(p.numel() for p in model.parameters()) == MOE.param_count()
    h, f, E, k = MOE.hidden, MOE.expert_ffn, MOE.experts, MOE.experts_per_token
    cost = CostModel(MOE, precision="fp32")
    block = cost.unit_flops(1, 1)[0]
    dense_equivalent = CostModel(MOE.__class__(**{**MOE.fields_dict(), "experts": 0, "experts_per_token": 0,
                                                   "expert_ffn": 0, "family": "llama",
                                                   "ffn": k * f}), precision="fp32").unit_flops(1, 1)[0]
    # a token computes with its k experts (as a dense MLP k times as wide) plus the router
    assert block == pytest.approx(dense_equivalent + 2 * MOE.seq_len * h * E)
    assert MOE.active_param_count() == MOE.param_count() - MOE.layers * (E - k) * 3 * h * f


def test_ep_holds_a_share_of_the_experts_per_gpu():
    full, split = CostModel(MOE, ep=1), CostModel(MOE, ep=2)
    experts = 3 * MOE.hidden * MOE.expert_ffn * MOE.experts
    assert full.unit_params(1) - split.unit_params(1) == experts // 2
    stage = build_units(MOE, 1, 2)          # what a rank holds of one block: 1/ep of each stacked expert tensor
    held = sum(p.numel() // (2 if ".experts." in n else 1) for n, p in stage.named_parameters())
    assert split.unit_params(1) == held


def test_all_to_all_time_counts_what_leaves_the_gpu():
    dc = load_spec(ROOT / "examples/llama2_70b_h100_3dc.toml").cluster.datacenters[0]
    one = all_to_all_time(8e6, 2, 8, dc)
    assert 0 < one < all_to_all_time(8e6, 4, 8, dc) < all_to_all_time(8e6, 16, 8, dc)   # 16: across nodes
    assert all_to_all_time(8e6, 1, 8, dc) == 0.0
    cost = CostModel(MOE, ep=4)
    assert cost.tp_comm_time(range(1, 3), 2, 1, dc) == pytest.approx(
        2 * 4 * all_to_all_time(2 * 2 * MOE.seq_len * MOE.hidden * 2, 4, dc.gpus_per_node, dc))


def _spec(tmp: Path, job: str, model: str = '"tiny-moe"', cluster: str = "tiny_2dc.toml") -> Path:
    path = tmp / "moe.toml"
    path.write_text(f'name = "m"\ncluster = "{ROOT / "examples/clusters" / cluster}"\nmodel = {model}\n'
                    f'[job]\nglobal_batch = 16\nprecision = "fp32"\n{job}')
    return path


def test_the_ep_degree_is_searched_like_tp(tmp_path):
    spec = load_spec(_spec(tmp_path, ""))
    assert ep_options(spec) == (1, 2)
    eps = {ctx.ep for ctx, _, _ in tp_groups(spec)}
    assert eps == {1, 2}
    assert all(lay.dp % ctx.ep == 0 for ctx, _, lays in tp_groups(spec) for lay in lays)
    dense = load_spec(_spec(tmp_path, "", '"tiny"'))
    assert ep_options(dense) == (1,)
    pinned = load_spec(_spec(tmp_path, "ep = 2\ndp = 2\n"))
    plan = plan_from_job(pinned)
    assert plan.ep == 2 and plan.dp % 2 == 0
    assert len({plan.dc_of(0, d) for d in range(plan.dp)}) == 1       # an EP group inside one DC


def test_region_layouts_keep_ep_groups_inside_a_dc(tmp_path):
    spec = load_spec(_spec(tmp_path, "tp = 1\n"))
    for ctx, _, layouts in tp_groups(spec):
        for lay in layouts:
            if lay.replicas and ctx.ep > 1:
                assert all(n % ctx.ep == 0 for n in lay.replicas), (lay, ctx.ep)


@pytest.mark.parametrize("job,model,field", [("ep = 2\n", '"tiny"', "job.ep"), ("ep = 3\n", '"tiny-moe"', "job.ep")])
def test_a_pinned_ep_the_model_cannot_have_is_one_line(tmp_path, job, model, field):
    with pytest.raises(SpecError) as e:
        load_spec(_spec(tmp_path, job, model))
    assert e.value.field == field and "\n" not in str(e.value)


def test_a_moe_block_gradient_reaches_the_router_through_the_aux_loss():
    """The load-balancing loss moves the router even where the language-model loss is zero."""
    block = build_units(MOE, 1, 2)
    x = torch.randn(2, 8, MOE.hidden)
    (block(x) * 0).sum().backward()
    assert block.units["1"].ffn.router.weight.grad.abs().sum() > 0
