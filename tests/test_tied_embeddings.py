"""The cost model counts a tied embedding matrix once per stage that holds it (training and
export of a tied checkpoint: tests/test_hf_train_export.py)."""

from geotrain.config.model import ModelSpec
from geotrain.cost.model import CostModel


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
