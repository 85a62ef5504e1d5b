"""--prefill-model: a Hugging Face directory (weights + tokenizer.json) served, context limits, headroom."""

import http.client
import json

import pytest

from geotrain.bubbletea.inference import prefill
from geotrain.bubbletea.model_source import load_inference_model
from geotrain.errors import GeotrainError

transformers = pytest.importorskip("transformers")


def _hf_dir_with_tokenizer(path):
    import torch
    from test_data_tokenizers import make_tokenizer_dir

    tok = make_tokenizer_dir(path)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=24)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return tok


def _post(url, body):
    host, port = url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request("POST", "/v1/completions", json.dumps(body))
    r = c.getresponse()
    return r.status, json.loads(r.read())


def test_an_hf_directory_is_served_with_its_weights_and_tokenizer(tmp_path):
    from geotrain.bubbletea.serve import start_service
    from geotrain.bubbletea.service import PrefillService

    tok = _hf_dir_with_tokenizer(tmp_path / "m")
    served = load_inference_model(str(tmp_path / "m"))
    assert served.name == "m" and served.tokenizer.vocab_size == tok.vocab_size
    svc = start_service(inference_model=str(tmp_path / "m"), unix=False)
    try:
        assert isinstance(svc.service, PrefillService)
        svc.executor.ready = lambda: True            # no training rank: finish_locally-style prefill below
        import threading

        def local():
            svc.executor.finish_locally(served.model, grace_s=0.0)

        prompt = "def add(a, b):"
        t = threading.Timer(0.5, local)
        t.start()
        status, doc = _post(svc.url, {"model": "m", "prompt": prompt, "max_tokens": 3, "temperature": 0})
        t.join()
        assert status == 200, doc
        ch = doc["choices"][0]
        assert doc["usage"]["prompt_tokens"] == len(tok.encode(prompt))
        assert ch["token_ids"][0] == prefill(served.model, tok.encode(prompt))[0]
        assert ch["text"] == tok.decode(ch["token_ids"])
        # A prompt past the context (24 positions) is a 400 naming the limit, not a silent cut.
        status, doc = _post(svc.url, {"prompt": "x " * 40, "max_tokens": 2})
        assert status == 400 and doc["error"]["code"] == "context_length_exceeded"
    finally:
        svc.close()


def test_max_tokens_past_the_context_finish_with_length(tmp_path):
    from geotrain.bubbletea.executor import DecodeWorker, DedicatedExecutor
    from geotrain.bubbletea.service import PrefillService

    _hf_dir_with_tokenizer(tmp_path / "m")
    served = load_inference_model(str(tmp_path / "m"))
    ex = DedicatedExecutor(served.model)
    svc = PrefillService(ex, DecodeWorker(served.model), max_new_tokens=64, vocab=served.spec.vocab,
                         max_prompt_tokens=23, tokenizer=served.tokenizer, model_name="m")
    host, port = svc.serve()
    try:
        prompt = list(range(20, 40))                       # 20 of the 24 positions
        status, doc = _post(f"http://{host}:{port}", {"prompt": prompt, "max_tokens": 50, "temperature": 0})
        ch = doc["choices"][0]
        assert status == 200 and ch["finish_reason"] == "length" and len(ch["token_ids"]) == 24 - 20 + 1
    finally:
        svc.close()
        ex.close()


def test_prefill_model_must_fit_beside_training(tmp_path):
    from geotrain.orchestrate.local_run import _check_headroom, _prefill_model
    from geotrain.planner.manual import plan_from_job
    from geotrain.spec.load import load_spec

    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096}))
    spec = load_spec("examples/tiny_2dc.toml")
    plan = plan_from_job(spec)
    with pytest.raises(GeotrainError, match="needs .* beside training"):
        _check_headroom(spec, plan, _prefill_model(str(big), tmp_path))
    _check_headroom(spec, plan, "tiny")
    with pytest.raises(GeotrainError, match="neither a model preset"):
        _prefill_model(str(tmp_path / "nothing"), tmp_path)


def test_the_shipped_demo_model_is_a_trained_python_model():
    """examples/models/py-tiny/weights (what `geotrain demo` serves) predicts Python source far
    better than chance (ln 256 = 5.5 nats per byte for an untrained byte model)."""
    import os
    from pathlib import Path

    import torch

    from geotrain.commands.demo_cmd import SERVED_MODEL
    from geotrain.runtime.interpreter import lm_loss

    served = load_inference_model(str(Path(__file__).parents[1] / SERVED_MODEL))
    text = Path(os.__file__).read_bytes()[:129 * 8]
    ids = torch.tensor(list(text)).view(8, 129)
    with torch.no_grad():
        loss = lm_loss(served.model(ids[:, :-1]), ids[:, 1:]).item()
    assert loss < 2.5, loss
    assert served.spec.vocab == 256 and served.name == "geotrain-py-tiny"
