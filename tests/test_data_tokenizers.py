"""Real tokenizers (tokenizer.json) for training data and serving; text, JSONL and directory corpora
tokenized once into a memory-mapped cache."""

import json

import numpy as np
import pytest

from geotrain.data import TokenBatches, load_corpus, load_tokenizer
from geotrain.data import corpus as corpus_module
from geotrain.data.tokenizer import ByteTokenizer, HFTokenizer

TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n", "class Stack:\n    pass\n",
         "for i in range(10):\n    print(i)\n"] * 5
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer_dir(path, vocab=300, chat=True):
    """A tiny byte-level BPE trained on a few strings, saved as a model directory would hold it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    conf = {"eos_token": "<eos>", **({"chat_template": CHAT} if chat else {})}
    (path / "tokenizer_config.json").write_text(json.dumps(conf))
    return HFTokenizer(path)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GEOTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    corpus_module._CACHE.clear()


def test_tokenizer_json_round_trips_and_the_byte_tokenizer_stays_default(tmp_path):
    tok = make_tokenizer_dir(tmp_path / "m")
    assert isinstance(load_tokenizer(tmp_path / "m"), HFTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer) and isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    ids = tok.encode("def add(x, y):\n    return x")
    assert tok.decode(ids) == "def add(x, y):\n    return x" and len(ids) < 28   # merges happened
    assert tok.eos_id == tok.tok.token_to_id("<eos>")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|user|>hi\n<|assistant|>"


def test_text_jsonl_and_directory_tokenized_once_into_a_memmap(tmp_path):
    tok = make_tokenizer_dir(tmp_path / "m")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text(TEXTS[0])
    (data / "b.jsonl").write_text(json.dumps({"text": TEXTS[1]}) + "\nnot json\n" + json.dumps({"other": 1}) + "\n"
                                  + json.dumps({"text": TEXTS[2]}) + "\n")
    c = load_corpus(data, tokenizer=tok)
    assert isinstance(c.tokens, np.memmap)
    want = [i for t in TEXTS[:3] for i in tok.encode(t) + [tok.eos_id]]
    assert c.tokens.tolist() == want
    cached = list((tmp_path / "cache").glob("*.uint16"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    corpus_module._CACHE.clear()
    again = load_corpus(data, tokenizer=tok)                   # a new process: reads the cache, no re-tokenizing
    assert again.tokens.tolist() == want and cached[0].stat().st_mtime_ns == stamp
    (data / "a.txt").write_text(TEXTS[3])                      # changed text: a new cache entry
    corpus_module._CACHE.clear()
    assert load_corpus(data, tokenizer=tok).tokens.tolist() != want
    a = TokenBatches(again.tokens, seq_len=8, global_batch=2, seed=3)
    b = TokenBatches(np.array(want), seq_len=8, global_batch=2, seed=3)
    assert all((a.global_batch(s)[0] == b.global_batch(s)[0]).all() for s in range(4))


def test_jsonl_with_the_byte_tokenizer(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "ab"}) + "\n" + json.dumps({"text": "cd"}) + "\n")
    assert bytes(load_corpus(f).tokens) == b"ab\0cd\0"


def test_chat_completions_with_a_templated_tokenizer_and_not_without(tmp_path):
    import http.client

    from geotrain.bubbletea.executor import DecodeWorker, DedicatedExecutor
    from geotrain.bubbletea.service import PrefillService
    from geotrain.models.llama import build_model
    from geotrain.spec.model import ModelSpec

    tok = make_tokenizer_dir(tmp_path / "m")
    model = build_model(ModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, ffn=48, vocab=tok.vocab_size,
                                  seq_len=64)).eval()
    out = {}
    for name, t in (("bpe", tok), ("bytes", ByteTokenizer())):
        ex = DedicatedExecutor(model)
        svc = PrefillService(ex, DecodeWorker(model), max_new_tokens=4, vocab=tok.vocab_size, tokenizer=t)
        host, port = svc.serve()
        c = http.client.HTTPConnection(host, port, timeout=30)
        c.request("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 3, "temperature": 0}))
        r = c.getresponse()
        out[name] = (r.status, json.loads(r.read()))
        svc.close()
        ex.close()
    status, doc = out["bpe"]
    assert status == 200 and doc["object"] == "chat.completion"
    assert doc["choices"][0]["message"]["role"] == "assistant"
    assert doc["usage"]["prompt_tokens"] == len(tok.encode("<|user|>hi\n<|assistant|>"))
    assert out["bytes"][0] == 400 and "chat template" in out["bytes"][1]["error"]["message"]


@pytest.mark.slow
def test_train_from_an_hf_dir_uses_its_tokenizer_on_jsonl_text(tmp_path, capfd):
    """The launcher tokenizes once into the cache; every rank opens it; the steps train."""
    from pathlib import Path

    import torch
    from _cli import geotrain
    transformers = pytest.importorskip("transformers")

    tok = make_tokenizer_dir(tmp_path / "m")
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 4))
    root = Path(__file__).parents[1]
    (tmp_path / "e.toml").write_text(
        f'cluster = "{root / "examples/clusters/tiny_2dc.toml"}"\nmodel = {{ hf = "m", seq_len = 16 }}\n'
        '[job]\nglobal_batch = 4\nmicro_batch = 2\nprecision = "fp32"\npp = 2\ndp = 1\nsteps = 2\n'
        'data = "d.jsonl"\n')
    rc, out, err = geotrain(capfd, "train", tmp_path / "e.toml", "--out", tmp_path / "run", "--wan", "off",
                            "--no-progress", env={"GEOTRAIN_CACHE_DIR": str(tmp_path / "cache")})
    assert rc == 0, out + err
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "losses.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)
    assert len(list((tmp_path / "cache").glob("*.uint16"))) == 1       # tokenized once, by the launcher
