"""Hugging Face directories of every family in: shape from config.json, weights from safetensors,
logits, greedy decode and the export equal transformers'.

The exactness grid: one tiny random model per family and variant, made with transformers' own
classes and save_pretrained (module-scoped: built once), checked three ways -- fp32 logits within
1e-5, KV-cache greedy decode equal to `generate`, and `export --hf` reloaded by transformers
(warnings as errors) as the same model_type, with equal logits and the same bos/eos ids.
`test_one_switch_wrong_is_caught` shows the comparison sees each family's switch."""

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch

from geotrain.bubbletea.inference import decode, prefill
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
VOCAB, SEQ = 128, 40
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=None)
LONG = [1.0, 1.5, 2.0, 4.0]          # longrope's per-dim factors (rotary_dim / 2 of them)


def _rope(kind, theta=10000.0, **kw):
    return {"rope_parameters": {"rope_type": kind, "rope_theta": theta, **kw}}


# name -> (transformers config class, its kwargs, save options, config.json keys added after saving)
VARIANTS = {
    "llama": ("LlamaConfig", {}, {}, {}),
    "llama-tied-mha": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=4), {}, {}),
    "llama-linear": ("LlamaConfig", _rope("linear", factor=2.0), {}, {}),
    "llama-dynamic": ("LlamaConfig", _rope("dynamic", factor=2.0), {}, {}),
    "llama-yarn": ("LlamaConfig", _rope("yarn", factor=2.0, original_max_position_embeddings=32), {}, {}),
    "llama3.1": ("LlamaConfig", _rope("llama3", 500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=16), {}, {}),
    "llama-longrope": ("LlamaConfig", _rope("longrope", long_factor=LONG, short_factor=[1.0, 1.1, 1.2, 1.3],
                                            original_max_position_embeddings=32), {}, {}),
    "llama-bias-head_dim": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, head_dim=16), {}, {}),
    "llama-sharded": ("LlamaConfig", {}, {"max_shard_size": "20KB"}, {}),
    "llama-bf16-file": ("LlamaConfig", {}, {"bf16": True}, {}),
    "smollm2": ("LlamaConfig", dict(tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=2), {},
                {"is_llama_config": True, "rope_interleaved": False}),
    "mistral-window": ("MistralConfig", dict(sliding_window=16, head_dim=16), {}, {}),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), {}, {}),
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), {}, {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16), {}, {}),
    "gemma": ("GemmaConfig", dict(head_dim=16), {}, {}),
    "phi3": ("Phi3Config", dict(pad_token_id=None, eos_token_id=2), {}, {}),
    "phi3-longrope-partial": ("Phi3Config", dict(
        pad_token_id=None, eos_token_id=2, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "long_factor": [1.0, 3.0], "short_factor": [1.0, 1.2]}), {}, {}),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16), {}, {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                         head_dim=16), {}, {}),
    "qwen3_moe-norm_topk": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=3, moe_intermediate_size=16,
                                                   norm_topk_prob=True), {}, {}),
    "qwen2_moe-shared": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                shared_expert_intermediate_size=24), {}, {}),
}


def _perturb(model, seed: int) -> None:
    """Constant-initialised parameters (norms, biases, some routers) perturbed, so a wrong mapping shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or p.std() < 1e-6:
                p.add_(torch.randn(p.shape, generator=g) * (0.1 if "norm" in n else 0.05))


def make_variant(path: Path, name: str, seed: int = 0):
    """Save variant `name` with save_pretrained into `path`; returns the fp32 transformers model."""
    cfg_cls, kwargs, opts, extra = VARIANTS[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **kwargs})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    _perturb(model, seed)
    saving = model.to(torch.bfloat16) if opts.get("bf16") else model
    saving.save_pretrained(path, **({"max_shard_size": opts["max_shard_size"]} if "max_shard_size" in opts else {}))
    if extra:
        doc = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**doc, **extra}))
    if opts.get("bf16"):    # the reference computes in fp32 from the same (rounded) weights
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model


def make_hf_dir(path, name="gqa-untied", layers=3, shard=False, seed=0):
    """A Llama directory of shape `name` (SHAPES), for tests that train or cut one."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                   max_position_embeddings=64, **SHAPES[name])
    model = transformers.LlamaForCausalLM(cfg).eval()
    _perturb(model, seed)
    model.save_pretrained(path, **({"max_shard_size": "40KB"} if shard else {}))
    return model


def _ours(spec, path=None, tied=None):
    model = build_model(spec).eval()
    load_hf_weights(model, path or spec.hf, spec.tie_embeddings if tied is None else tied)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    ref = make_variant(path, request.param)
    spec = load_model(path)
    return request.param, path, ref, spec


TOKENS = torch.randint(2, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_logits_equal_transformers(variant):
    name, path, ref, spec = variant
    assert spec.family == ref.config.model_type
    if "sharded" in name:
        assert (path / "model.safetensors.index.json").is_file()
    model = _ours(spec)
    with torch.no_grad():
        for tokens in (TOKENS, TOKENS[:, :20]):           # longrope: past and within the original context
            torch.testing.assert_close(model(tokens), ref(tokens).logits, rtol=0, atol=1e-5)
        bf16 = model.to(torch.bfloat16)(TOKENS)            # a bf16 model runs, close to fp32's
        assert bf16.dtype == torch.bfloat16 and torch.isfinite(bf16).all()


def test_kv_cache_greedy_decode_equals_generate(variant):
    name, _, ref, spec = variant
    model = _ours(spec)
    prompt = TOKENS[0, :30].tolist()                      # decode crosses position 32 (longrope's original)
    first, cache = prefill(model, prompt, chunk=12)
    ours = [first, *decode(model, first, cache, 7)]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    assert ours == out[0, 30:].tolist(), name


def test_export_reloads_as_the_same_model(variant, tmp_path):
    import torch.distributed.checkpoint as dcp

    from geotrain.runtime.hf_export import export_hf

    name, path, ref, spec = variant
    model = _ours(spec)
    root = tmp_path / "run" / "checkpoints"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)    # "torch.distributed is uninitialized": one process
        dcp.save({"model": dict(model.state_dict())}, checkpoint_id=str(root / "step_00000001"), no_dist=True)
    (root / "latest").write_text("step_00000001\n")
    out = export_hf(tmp_path / "run", tmp_path / "out", spec, dtype="float32")
    doc = json.loads((out / "config.json").read_text())
    assert (doc["model_type"], doc["bos_token_id"], doc["eos_token_id"]) == (
        ref.config.model_type, ref.config.bos_token_id, ref.config.eos_token_id)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(ref)
    assert back.config.tie_word_embeddings == spec.tie_embeddings
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, ref(TOKENS).logits, rtol=0, atol=1e-5)
    assert load_model(out).shape == dataclasses.replace(spec.shape, name=load_model(out).name)


def _without_qk_norm(model):
    for unit in model.units.values():
        if hasattr(unit, "attn"):
            unit.attn.q_norm = unit.attn.k_norm = None
    return model


# variant -> the same weights under a shape with one switch wrong
WRONG = {
    "qwen3": ("q/k norm off", None),
    "gemma": ("embedding scale off", dict(embed_scale=False)),
    "mistral-window": ("no sliding window", dict(sliding_window=0)),
    "llama3.1": ("plain RoPE", dict(rope_scaling=())),
    "llama-yarn": ("no attention factor", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "phi3-longrope-partial": ("whole heads rotated", dict(partial_rotary=1.0, rope_scaling=())),
    "qwen3_moe-norm_topk": ("top-k weights not renormalised", dict(norm_topk=False)),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_one_switch_wrong_is_caught(name, tmp_path):
    ref = make_variant(tmp_path, name)
    spec = load_model(tmp_path)
    what, change = WRONG[name]
    if change is None:
        model = _without_qk_norm(_ours(spec))
    else:
        model = _ours(dataclasses.replace(spec.shape, **change), tmp_path, spec.tie_embeddings)
    with torch.no_grad():
        diff = (model(TOKENS) - ref(TOKENS).logits).abs().max().item()
    assert diff > 1e-3, f"{name} with {what}: logits still within {diff:g}"


def test_a_stage_reads_only_its_own_tensors(tmp_path):
    make_hf_dir(tmp_path, "gqa-sharded", layers=4, shard=True)
    spec = load_model(tmp_path)
    stage = build_units(spec, 2, 4)          # blocks 2 and 3 = HF layers 1 and 2
    read, fresh = load_hf_weights(stage, spec.hf)
    assert read and not fresh and all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in read)


def test_spec_with_hf_table_and_seq_len(tmp_path):
    make_hf_dir(tmp_path / "m")
    cluster = Path(__file__).parents[1] / "examples" / "clusters" / "tiny_2dc.toml"
    (tmp_path / "e.toml").write_text(f'cluster = "{cluster}"\nmodel = {{ hf = "m", seq_len = 32 }}\n[job]\n'
                                     'global_batch = 4\nmicro_batch = 2\n')
    spec = load_spec(tmp_path / "e.toml")
    assert spec.model.seq_len == 32 and spec.model.hf == str((tmp_path / "m").resolve())


@pytest.mark.parametrize("key,value,field", [
    ("hidden_act", "gelu", "hidden_act"), ("attention_dropout", 0.1, "attention_dropout"),
    ("rope_parameters", {"rope_type": "su", "factor": 2.0, "rope_theta": 1e4}, "rope_scaling.rope_type"),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4}, "rope_scaling.factor"),
    ("rope_theta", "big", "rope_theta"), ("rope_theta", [1.0], "rope_theta"), ("rope_theta", 5.0, "rope_theta"),
    ("rope_interleaved", True, "rope_interleaved"), ("sliding_window", 128, "sliding_window"),
    ("model_type", "gpt2", "model_type"), ("model_type", "mistral", "architectures"),
    ("num_local_experts", 4, "num_local_experts"), ("router_jitter_noise", 0.1, "router_jitter_noise"),
])
def test_unsupported_config_field_is_one_line_naming_it(tmp_path, key, value, field):
    make_hf_dir(tmp_path)
    doc = json.loads((tmp_path / "config.json").read_text())
    doc[key] = value
    (tmp_path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(SpecError) as e:
        load_model(tmp_path)
    assert e.value.field == field and "\n" not in str(e.value)


def _retag(path: Path, **changes) -> None:
    doc = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**doc, **changes}))


def test_qwen_weights_under_a_llama_config_are_refused_naming_the_tensor(tmp_path):
    """Qwen2's q/k/v biases and Qwen3's q/k norms in a directory whose config.json says llama:
    transformers reports the unused tensors; so does geotrain, in one line, instead of dropping them."""
    for name, tensor in (("qwen2", "self_attn.k_proj.bias"), ("qwen3", "self_attn.k_norm.weight")):
        make_variant(tmp_path / name, name)
        _retag(tmp_path / name, model_type="llama", architectures=["LlamaForCausalLM"])
        with pytest.raises(SpecError, match=tensor) as e:
            load_model(tmp_path / name)
        assert e.value.field == "hf" and "\n" not in str(e.value) and "not use it" in str(e.value)


def test_an_untied_config_without_lm_head_is_refused_unless_allow_missing(tmp_path, capsys):
    """config.json says untied but the file has no lm_head.weight: not run tied in silence -- an
    error naming the tensor; `allow_missing = true` starts the head from the init and says so."""
    make_variant(tmp_path / "m", "llama-tied-mha")
    _retag(tmp_path / "m", tie_word_embeddings=False)
    with pytest.raises(SpecError, match=r"lm_head.weight is missing .*tie_word_embeddings = false") as e:
        load_model(tmp_path / "m")
    assert "\n" not in str(e.value)
    (tmp_path / "m.toml").write_text('hf = "m"\nallow_missing = true\n')
    spec = load_model(tmp_path / "m.toml")
    from geotrain.runtime.materialize import materialize

    with torch.device("meta"):
        model = build_units(spec, init=False)
    materialize(model, spec, torch.device("cpu"), spec.hf)
    err = capsys.readouterr().err
    assert f"units.{spec.layers + 1}.out.weight" in err and "allow_missing" in err
    head = model.units[str(spec.layers + 1)].out.weight
    assert not torch.equal(head, model.units["0"].tok.weight)      # its own matrix, from the init
    from geotrain.models.llama import initial_rows

    torch.testing.assert_close(head, initial_rows(spec, spec.layers + 1, "out.weight", tuple(head.shape)))


def test_a_missing_block_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_variant(tmp_path, "llama")
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(SpecError, match=r"model.layers.1.mlp.up_proj.weight is missing"):
        load_model(tmp_path)
