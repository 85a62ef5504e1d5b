"""Hugging Face Llama directories in: shape from config.json, weights from safetensors, logits equal."""

import json
from pathlib import Path

import pytest
import torch

from geotrain.errors import SpecError
from geotrain.models.hf_weights import load_hf_weights
from geotrain.models.llama import build_model, build_units
from geotrain.spec.load import load_model, load_spec

transformers = pytest.importorskip("transformers")

SHAPES = {
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=500000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True),
    "gqa-sharded": dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=1000.0, rms_norm_eps=3e-5,
                        tie_word_embeddings=False),
}


def make_hf_dir(path, name="gqa-untied", layers=3, shard=False, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                   max_position_embeddings=64, **SHAPES[name])
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1: perturb them so a wrong mapping shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, **({"max_shard_size": "40KB"} if shard else {}))
    return model


@pytest.mark.parametrize("name", list(SHAPES))
def test_logits_equal_transformers(tmp_path, name):
    shard = name.endswith("sharded")
    ref = make_hf_dir(tmp_path, name, shard=shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    spec = load_model(tmp_path)
    assert (spec.kv_heads, spec.rope_theta, spec.norm_eps) == (
        SHAPES[name]["num_key_value_heads"], SHAPES[name]["rope_theta"], SHAPES[name]["rms_norm_eps"])
    model = build_model(spec).eval()
    load_hf_weights(model, spec.hf, spec.layers, spec.tie_embeddings)
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        theirs = ref(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_stage_reads_only_its_own_tensors(tmp_path):
    make_hf_dir(tmp_path, "gqa-sharded", layers=4, shard=True)
    spec = load_model(tmp_path)
    stage = build_units(spec, 2, 4)          # blocks 2 and 3 = HF layers 1 and 2
    read = load_hf_weights(stage, spec.hf, spec.layers)
    assert read and all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in read)


def test_spec_with_hf_table_and_seq_len(tmp_path):
    make_hf_dir(tmp_path / "m")
    cluster = Path(__file__).parents[1] / "examples" / "clusters" / "tiny_2dc.toml"
    (tmp_path / "e.toml").write_text(f'cluster = "{cluster}"\nmodel = {{ hf = "m", seq_len = 32 }}\n[job]\n'
                                     'global_batch = 4\nmicro_batch = 2\n')
    spec = load_spec(tmp_path / "e.toml")
    assert spec.model.seq_len == 32 and spec.model.hf == str((tmp_path / "m").resolve())


@pytest.mark.parametrize("key,value,field", [
    ("hidden_act", "gelu", "hidden_act"), ("attention_bias", True, "attention_bias"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "rope_parameters"),
    ("sliding_window", 128, "sliding_window"), ("model_type", "mistral", "model_type"),
])
def test_unsupported_config_field_is_one_line_naming_it(tmp_path, key, value, field):
    make_hf_dir(tmp_path)
    doc = json.loads((tmp_path / "config.json").read_text())
    doc[key] = value
    (tmp_path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(SpecError) as e:
        load_model(tmp_path)
    assert e.value.field == field and "\n" not in str(e.value)
