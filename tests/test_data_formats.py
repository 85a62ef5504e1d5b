"""Every data format read to the same tokens as a reference reader (bytes and a tokenizer.json),
weighted mixtures, no silent cap, and bad data refused with one line naming the file."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os

import numpy as np
import pytest

from geotrain.data import ByteTokenizer, TokenBatches, data_report, load_corpus, open_batches
from geotrain.data import corpus as corpus_module
from geotrain.data.tokenizer import HFTokenizer
from geotrain.errors import GeotrainError

DOCS = ["def add(a, b):\n    return a + b\n", "héllo wörld, 世界\n", "class Stack:\n    pass\n", "x = 1\n" * 3]
CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHATS = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
         [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GEOTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    corpus_module._CACHE.clear()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFTokenizer:
    """A tiny byte-level BPE with BOS, EOS and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "chat_template": CHAT}))
    return HFTokenizer(path)


def reference(texts: list[str], tok) -> list[int]:
    """What a plain loop makes of documents: BOS + ids + EOS each (bytes: UTF-8 + NUL)."""
    if isinstance(tok, ByteTokenizer):
        return list(b"".join(t.encode() + b"\0" for t in texts))
    out = []
    for t in texts:
        head = [] if t.startswith("<s>") else [tok.bos_id]
        tail = [] if t.endswith("</s>") else [tok.eos_id]
        out += head + tok.tok.encode(t, add_special_tokens=False).ids + tail
    return out


def jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def write_formats(d):
    """One file per format holding DOCS; returns {name: (path, field)}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir(parents=True, exist_ok=True)
    recs = [{"text": t, "id": i} for i, t in enumerate(DOCS)]
    (d / "a.jsonl").write_bytes(jsonl(recs))
    (d / "content.jsonl").write_bytes(jsonl([{"content": t} for t in DOCS]))
    (d / "b.json").write_text(json.dumps(recs))
    (d / "strings.json").write_text(json.dumps(DOCS))
    (d / "lines.json").write_bytes(jsonl(recs))                  # JSON Lines in a .json file
    (d / "c.jsonl.gz").write_bytes(gzip.compress(jsonl(recs)))
    (d / "d.json.xz").write_bytes(lzma.compress(json.dumps(recs).encode()))
    (d / "e.jsonl.bz2").write_bytes(bz2.compress(jsonl(recs)))
    zstd = pytest.importorskip("zstandard")
    (d / "f.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(jsonl(recs)))
    pq.write_table(pa.table({"id": list(range(4)), "text": DOCS}), d / "g.parquet", row_group_size=2)
    with pa.OSFile(str(d / "h.arrow"), "wb") as sink, pa.ipc.new_stream(sink, pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": DOCS}))
    return {"jsonl": ("a.jsonl", "text"), "jsonl content": ("content.jsonl", "content"), "json": ("b.json", "text"),
            "json strings": ("strings.json", "text"), "json lines": ("lines.json", "text"),
            "gz": ("c.jsonl.gz", "text"), "xz": ("d.json.xz", "text"), "bz2": ("e.jsonl.bz2", "text"),
            "zst": ("f.jsonl.zst", "text"), "parquet": ("g.parquet", "text"), "arrow": ("h.arrow", "text")}


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_every_format_reads_to_the_reference_tokens(tmp_path, tokenizer, bpe):
    tok = ByteTokenizer() if tokenizer == "bytes" else bpe
    want = reference(DOCS, tok)
    for name, (f, field) in write_formats(tmp_path / "d").items():
        c = load_corpus(tmp_path / "d" / f, tokenizer=tok, field=field, progress=False)
        assert c.tokens.tolist() == want, name
        assert c.documents == len(DOCS), name
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(DOCS[1].encode()))
    (tmp_path / "t.py").write_text(DOCS[0])
    assert load_corpus(tmp_path / "t.txt.gz", tokenizer=tok).tokens.tolist() == reference(DOCS[1:2], tok)
    assert load_corpus(tmp_path / "t.py", tokenizer=tok).tokens.tolist() == reference(DOCS[:1], tok)


def test_datasets_folders_read_like_datasets_loads_them(tmp_path, bpe):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": DOCS, "n": list(range(4))})
    ds.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": ds, "validation": ds.select([1, 2])}).save_to_disk(str(tmp_path / "dd"))
    for tok in (ByteTokenizer(), bpe):
        texts = datasets.load_from_disk(str(tmp_path / "one"))["text"]
        assert load_corpus(tmp_path / "one", tokenizer=tok).tokens.tolist() == reference(list(texts), tok)
        val = datasets.load_from_disk(str(tmp_path / "dd"))["validation"]["text"]
        got = load_corpus(tmp_path / "dd", tokenizer=tok, split="validation").tokens.tolist()
        assert got == reference(list(val), tok)
    with pytest.raises(GeotrainError, match="no split 'test'"):
        load_corpus(tmp_path / "dd", split="test")


def test_chat_messages_rendered_with_the_chat_template(tmp_path, bpe):
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe.path), bos_token="<s>", eos_token="</s>")
    ref.chat_template = CHAT
    texts = [ref.apply_chat_template(m, tokenize=False) for m in CHATS]
    assert texts[0] == "<s><|user|>hi</s><|assistant|>hello there</s>"
    (tmp_path / "chat.jsonl").write_bytes(jsonl([{"messages": m} for m in CHATS]))
    c = load_corpus(tmp_path / "chat.jsonl", tokenizer=bpe, field="messages")
    assert c.tokens.tolist() == reference(texts, bpe)          # no second BOS / EOS around a rendered chat
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": CHATS}), tmp_path / "chat.parquet")
    assert load_corpus(tmp_path / "chat.parquet", tokenizer=bpe, field="messages").tokens.tolist() == \
        reference(texts, bpe)
    with pytest.raises(GeotrainError, match="chat.jsonl: field 'messages' holds chat messages but the tokenizer"):
        load_corpus(tmp_path / "chat.jsonl", field="messages")          # the byte tokenizer has no template


def test_a_folder_reads_every_known_file_and_lists_the_others(tmp_path):
    d = tmp_path / "d"
    names = write_formats(d)
    (d / "content.jsonl").unlink()
    (d / "sub").mkdir()
    (d / "sub" / "notes.csv").write_text("a,b\n")
    (d / ".hidden.txt").write_text("secret")
    c = load_corpus(d, field="text")
    assert [os.path.basename(f) for f in c.counts["skipped_files"]] == ["notes.csv"]
    assert c.documents == len(DOCS) * (len(names) - 1)
    assert c.tokens.tolist() == reference(DOCS, ByteTokenizer()) * (len(names) - 1)
    assert b"secret" not in c.tokens.tobytes() and b"a,b" not in c.tokens.tobytes()


def test_content_jsonl_without_the_field_is_refused_in_a_folder(tmp_path):
    d = tmp_path / "d"
    write_formats(d)
    with pytest.raises(GeotrainError, match=r"content.jsonl: no record has a text or chat field 'text'"):
        load_corpus(d)


def test_weighted_sources_mix_in_proportion_and_report_their_epochs(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 4000)
    (tmp_path / "b.jsonl").write_bytes(jsonl([{"content": "b" * 100}] * 40))

    class Src:
        def __init__(self, path, weight, field="text"):
            self.path, self.weight, self.field, self.split = str(path), weight, field, "train"

    data = [Src(tmp_path / "a.txt", 3.0), Src(tmp_path / "b.jsonl", 1.0, "content")]
    b = open_batches(data, seq_len=10, global_batch=8, dp=2, micro_batch=2, seed=1)
    rows = np.concatenate([b.global_batch(s)[0].numpy() for s in range(200)])
    share_a = np.mean(rows[:, 0] == ord("a"))
    assert abs(share_a - 0.75) < 0.01
    again = open_batches(data, seq_len=10, global_batch=8, dp=4, micro_batch=1, seed=1)
    assert all((again.global_batch(s)[0] == b.global_batch(s)[0]).all() for s in (0, 7, 150))
    rep = data_report(b, steps=200)
    a, bb = rep["sources"]
    assert a["documents"] == 1 and bb["documents"] == 40 and a["tokens"] == 4001 and bb["tokens"] == 40 * 101
    assert a["epochs"] == pytest.approx(1200 / 400, rel=0.01) and bb["epochs"] == pytest.approx(400 / 404, rel=0.01)
    # within one source's epoch no window repeats
    ids = np.concatenate([b.window_ids(s) for s in range(30)])
    a_ids = ids[ids < b.source_windows[0]]
    assert len(set(a_ids[:400].tolist())) == min(400, len(a_ids[:400]))


def test_held_out_windows_are_never_trained_on():
    tokens = np.arange(16 * 100 + 1) % 251
    b = TokenBatches(tokens, seq_len=16, global_batch=8, holdout=0.1)
    assert b.held_out == [10] and b.num_windows == 90
    trained = {int(w) for s in range(60) for w in b.window_ids(s)}
    assert trained == set(range(90))
    x, _ = b.eval_batch(0)
    starts = {int(r[0]) for r in x}
    assert starts == {int(tokens[w * 16]) for w in range(90, 98)}


def test_no_silent_cap_on_user_data(tmp_path):
    f = tmp_path / "big.jsonl"
    line = json.dumps({"text": "z" * 999}) + "\n"
    n = (corpus_module.DEFAULT_MAX_BYTES // 1000) + 500           # past the built-in corpus's cap
    f.write_text(line * n)
    c = load_corpus(f)
    assert len(c) == n * 1000 and c.documents == n


@pytest.mark.parametrize("case", ["gz-not-gzip", "gz-truncated", "gz-binary", "parquet-damaged", "parquet-no-column",
                                  "parquet-int-column", "arrow-damaged", "binary-txt", "unknown-ext", "empty-folder",
                                  "folder-unknown", "json-object", "jsonl-no-field", "xz-damaged", "zst-not-zstd",
                                  "hf-missing-shard"])
def test_bad_data_is_one_line_naming_the_file(tmp_path, case):
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = jsonl([{"text": t} for t in DOCS * 200])
    target = {
        "gz-not-gzip": ("d.jsonl.gz", recs), "gz-truncated": ("d.jsonl.gz", gzip.compress(recs)[:-20]),
        "gz-binary": ("d.txt.gz", gzip.compress(bytes(range(256)) * 4)), "binary-txt": ("d.txt", b"ab\x00cd"),
        "unknown-ext": ("d.bin", b"hello"), "json-object": ("d.json", b'{"a": 1}'),
        "jsonl-no-field": ("d.jsonl", jsonl([{"body": "x"}])),
        "xz-damaged": ("d.txt.xz", lzma.compress(b"x" * 999)[:40]),
        "zst-not-zstd": ("d.txt.zst", gzip.compress(b"hello")),
        "arrow-damaged": ("d.arrow", b"\xff\xff\xff\xff" + b"x" * 64),
    }
    if case.startswith("parquet"):
        name = "d.parquet"
        table = pa.table({"text": DOCS * 50} if case != "parquet-int-column" else {"text": list(range(200))})
        if case == "parquet-no-column":
            table = pa.table({"body": DOCS})
        pq.write_table(table, tmp_path / name)
        if case == "parquet-damaged":
            raw = (tmp_path / name).read_bytes()
            (tmp_path / name).write_bytes(raw[:4] + b"\x00" * 200 + raw[204:])
        path = tmp_path / name
    elif case == "empty-folder":
        path = tmp_path / "empty"
        path.mkdir()
    elif case == "folder-unknown":
        path = tmp_path / "dir"
        path.mkdir()
        (path / "x.png").write_bytes(b"\x89PNG....")
    elif case == "hf-missing-shard":
        path = tmp_path / "ds"
        path.mkdir()
        (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00002.arrow"},
                                                                     {"filename": "data-00001-of-00002.arrow"}]}))
        (path / "data-00000-of-00002.arrow").write_bytes(b"")
    else:
        name, raw = target[case]
        path = tmp_path / name
        path.write_bytes(raw)
    with pytest.raises(GeotrainError) as e:
        load_corpus(path, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data: ") and str(tmp_path) in msg, msg
    assert len(list((tmp_path / "cache").glob("*.uint8"))) == 0     # nothing half-written is kept


def test_cache_key_is_the_tokenizer_and_the_contents(tmp_path, bpe):
    f = tmp_path / "d.txt"
    f.write_text("abcd")
    st = f.stat()
    assert load_corpus(f).tokens.tolist() == list(b"abcd\0")
    f.write_text("wxyz")                                 # same size, same mtime: only the contents differ
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    corpus_module._CACHE.clear()
    assert load_corpus(f).tokens.tolist() == list(b"wxyz\0")
    assert load_corpus(f, tokenizer=bpe).tokens.tolist() == reference(["wxyz"], bpe)
    cache = tmp_path / "cache"
    assert len(list(cache.glob("*.uint8"))) == 2 and len(list(cache.glob("*.uint16"))) == 1
