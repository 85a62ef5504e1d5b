"""The cost model counts a tied embedding matrix once per stage that holds it (training and
export of a tied checkpoint: tests/test_hf_train_export.py)."""

import pytest

from geotrain.costs.cost_model import CostModel
from geotrain.spec.model import ModelSpec


def test_the_cost_model_counts_a_tied_matrix_once_per_stage_that_holds_it():
    shape = dict(layers=2, hidden=32, heads=4, kv_heads=4, ffn=48, vocab=300, seq_len=32)
    untied, tied = CostModel(ModelSpec(**shape)), CostModel(ModelSpec(**shape, tie_embeddings=True))
    whole, first, last = range(0, 4), range(0, 2), range(2, 4)
    assert tied.stage_params(whole) == untied.stage_params(whole) - 300 * 32
    assert tied.stage_params(first) == untied.stage_params(first)     # a pipeline: a copy on each end
    assert tied.stage_params(last) == untied.stage_params(last)
    assert tied.grad_bytes(whole) == untied.grad_bytes(whole) - 2 * 300 * 32


def test_a_tied_models_parameter_count_counts_the_matrix_once():
    """The spec's parameter count (the fit check's weights, `estimate`'s header, the export's
    size) is what a tied model stores: the built pp=1 model's unique parameters."""
    from geotrain.models.llama import build_units

    shape = dict(layers=2, hidden=32, heads=4, kv_heads=4, ffn=48, vocab=300, seq_len=32)
    tied, untied = ModelSpec(**shape, tie_embeddings=True), ModelSpec(**shape)
    model = build_units(tied.shape)
    model.tie_head_to_embedding()
    assert tied.param_count() == sum(p.numel() for p in model.parameters())
    assert untied.param_count() == tied.param_count() + 300 * 32


def _tied_spec(tmp_path, tie: bool):
    from pathlib import Path

    from geotrain.spec import load_spec

    root = Path(__file__).resolve().parents[1] / "examples"
    text = (root / "tiny_2dc.toml").read_text().replace('cluster = "clusters/tiny_2dc.toml"',
                                                         f'cluster = "{root / "clusters" / "tiny_2dc.toml"}"')
    text = text.replace('model = "tiny"', f'model = {{ preset = "tiny", tie_embeddings = {str(tie).lower()} }}')
    path = tmp_path / f"tied-{tie}.toml"
    path.write_text(text)
    return load_spec(path)


def test_the_simulator_and_the_planner_price_the_tied_gradient_sum(tmp_path):
    """pp=2 over east/west: the first and last stage sum their copies' gradients across the WAN
    before the step (runtime.tied). Both ends' sync grows by the sum's time -- dp x tp pairs of
    fp32 shards sharing the link -- in the simulator and in the planner's estimate alike."""
    from geotrain.costs import comm
    from geotrain.planner.context import PlanningContext
    from geotrain.planner.manual import plan_from_job
    from geotrain.planner.plan_score import plan_stage_costs
    from geotrain.sim import simulate

    tied, untied = _tied_spec(tmp_path, True), _tied_spec(tmp_path, False)
    plan = plan_from_job(tied)
    cost = CostModel(tied.model, precision=plan.precision)
    nbytes = cost.tied_grad_bytes(plan.sharding, plan.dp)
    m = tied.model
    assert nbytes == m.vocab * m.hidden * 4 // plan.dp        # zero3: each rank sums its 1/dp shard, in fp32
    link = tied.cluster.link("east", "west")
    want = plan.dp * nbytes / (link.rate_gbps(plan.dp) * comm.GBIT) + 2 * link.latency_ms * 1e-3

    def allreduce(spec, stage):
        ev = [e for e in simulate(spec, plan).trace.events if e.kind == "allreduce" and e.stage == stage]
        return ev[0].end - ev[0].start

    for stage in (0, 1):
        assert allreduce(tied, stage) - allreduce(untied, stage) == pytest.approx(want, rel=1e-9)
    syncs = [[c.allreduce for c in plan_stage_costs(PlanningContext(spec, None, tp=1), plan)]
             for spec in (tied, untied)]
    assert [a - b for a, b in zip(*syncs)] == pytest.approx([want, want], rel=1e-9)
