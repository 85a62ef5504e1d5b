import pytest
import torch

from geotrain.models.llama import build_model, build_units
from geotrain.models.presets import PRESETS


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_param_count_matches_spec(name):
    spec = PRESETS[name]
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.param_count()


def test_stages_compose_to_the_whole_model():
    spec = PRESETS["tiny"]
    x = torch.randint(0, spec.vocab, (2, spec.seq_len))
    whole = build_model(spec)(x)
    cut = build_units(spec, 3, spec.num_units)(build_units(spec, 0, 3)(x))
    torch.testing.assert_close(cut, whole)


def test_big_presets_have_their_published_sizes():
    expect = {"llama2-7b": 6.74e9, "llama2-13b": 13.0e9, "llama2-70b": 69.0e9, "gpt3-175b": 175e9,
              "llama3.1-8b": 8.03e9, "llama3.1-70b": 70.6e9, "qwen3-8b": 8.19e9, "mistral-7b": 7.24e9,
              "qwen3-30b-a3b": 30.5e9}
    for name, n in expect.items():
        assert abs(PRESETS[name].param_count() - n) / n < 0.02, name


def test_the_moe_preset_has_its_published_active_size():
    assert abs(PRESETS["qwen3-30b-a3b"].active_param_count() - 3.3e9) / 3.3e9 < 0.02
