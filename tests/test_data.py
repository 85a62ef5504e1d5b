"""Data: byte tokenizer, built-in and user corpora, and the deterministic, resumable DP loader."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from geotrain.data import ByteTokenizer, TokenBatches, load_corpus, open_batches, resolve_data_path, stdlib_files
from geotrain.data import corpus as corpus_mod
from geotrain.errors import GeotrainError


def small_tokens(n: int = 5000, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# -- tokenizer ------------------------------------------------------------------------------------
def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo, 世界' + x  # ✓\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text and tok.decode(np.array(ids)) == text
    assert tok.encode_array(text).tolist() == ids
    assert tok.decode(ids[:-3] + [0xE4]).endswith("\ufffd")  # cut inside a character: replaced, not raised
    with pytest.raises(ValueError):
        tok.decode([65, 300])


# -- corpora --------------------------------------------------------------------------------------
def test_builtin_corpus_is_the_stdlib_sources_capped_and_deterministic():
    corpus_mod._CACHE.clear()
    a = load_corpus()
    corpus_mod._CACHE.clear()
    b = load_corpus(max_bytes=corpus_mod.DEFAULT_MAX_BYTES)
    assert a is not b and np.array_equal(a.tokens, b.tokens) and a.files == b.files
    assert len(a) == corpus_mod.DEFAULT_MAX_BYTES  # the stdlib is bigger than the cap
    root = Path(os.__file__).resolve().parent
    assert all(f.endswith(".py") and Path(f).is_relative_to(root) for f in a.files)
    assert not any("site-packages" in f or "/test/" in f for f in a.files)
    used = set(a.files)
    assert list(a.files) == [str(p) for p in stdlib_files() if str(p) in used]  # sorted path order
    assert b"\ndef " in a.tokens.tobytes() and b"import " in a.tokens.tobytes()
    assert not a.tokens.flags.writeable
    assert load_corpus() is b  # cached per process


def test_builtin_corpus_builds_in_under_a_second():
    best = float("inf")
    for _ in range(2):
        corpus_mod._CACHE.clear()
        t0 = time.perf_counter()
        load_corpus()
        best = min(best, time.perf_counter() - t0)
    assert best < 1.0, f"corpus build took {best:.2f} s"


def test_user_file_and_directory(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("second")
    (tmp_path / "d" / "a.txt").write_text("first")
    (tmp_path / "d" / "sub" / "c.md").write_text("third")
    (tmp_path / "d" / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "d" / ".hidden").write_text("secret")
    one = load_corpus(tmp_path / "d" / "a.txt")
    assert one.tokens.tobytes().startswith(b"first") and len(one.files) == 1
    tree = load_corpus(tmp_path / "d")
    text = tree.tokens.tobytes()
    assert text.index(b"first") < text.index(b"second") < text.index(b"third")
    assert b"binary" not in text and b"secret" not in text
    assert text == b"first\0second\0third\0"            # each file one document, NUL after each
    assert len(load_corpus(tmp_path / "d", max_bytes=7)) == len(tree)    # the cap is the built-in corpus's only


def test_bad_user_data_is_a_one_line_user_error(tmp_path):
    with pytest.raises(GeotrainError, match="no such file"):
        load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GeotrainError, match="no readable files"):
        load_corpus(tmp_path / "empty")


def test_data_paths_are_relative_to_the_spec(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello")
    spec = tmp_path / "exp.toml"
    assert resolve_data_path(None, spec) is None and resolve_data_path("stdlib", spec) is None
    assert resolve_data_path("corpus.txt", spec) == tmp_path / "corpus.txt"
    assert resolve_data_path("/abs/x.txt", spec) == Path("/abs/x.txt")


# -- loader ---------------------------------------------------------------------------------------
def test_rows_are_corpus_windows_with_targets_shifted_by_one():
    tokens = small_tokens()
    b = TokenBatches(tokens, seq_len=16, global_batch=8, dp=2, micro_batch=2)
    x, y = b.global_batch(5)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, w in zip(x, b.window_ids(5)):
        assert row.tolist() == tokens[w * 16: w * 16 + 16].tolist()


def test_batches_are_deterministic_and_depend_on_the_seed():
    tokens = small_tokens()
    a = TokenBatches(tokens, seq_len=16, global_batch=8, seed=3)
    b = TokenBatches(tokens, seq_len=16, global_batch=8, seed=3)
    c = TokenBatches(tokens, seq_len=16, global_batch=8, seed=4)
    for step in (0, 1, 7, 100):
        assert torch.equal(a.global_batch(step)[0], b.global_batch(step)[0])
    assert not torch.equal(a.global_batch(0)[0], c.global_batch(0)[0])
    assert not torch.equal(a.global_batch(0)[0], a.global_batch(1)[0])


def test_replicas_get_disjoint_shards_and_each_epoch_visits_every_window_once():
    tokens = small_tokens(16 * 40 + 1)  # exactly 40 windows
    b = TokenBatches(tokens, seq_len=16, global_batch=8, dp=4, micro_batch=1)
    assert b.num_windows == 40
    per_replica: dict[int, set[int]] = {r: set() for r in range(4)}
    for step in range(5):  # one epoch = 5 steps of 8
        for r in range(4):
            ids = b.window_ids(step, range(r * 2, r * 2 + 2))
            per_replica[r].update(ids.tolist())
    shards = list(per_replica.values())
    assert all(len(s) == 10 for s in shards)
    assert set().union(*shards) == set(range(40))  # disjoint: 4 x 10 distinct windows
    epoch1 = np.concatenate([b.window_ids(s) for s in range(5, 10)])
    assert sorted(epoch1.tolist()) == list(range(40))
    assert not np.array_equal(epoch1, np.concatenate([b.window_ids(s) for s in range(5)]))  # reshuffled


def test_resuming_at_step_k_gives_the_uninterrupted_batches():
    tokens = small_tokens()
    full = TokenBatches(tokens, seq_len=8, global_batch=6, dp=3, micro_batch=1, seed=9)
    uninterrupted = [mb for _, (step, mbs) in zip(range(12), full.iterate(replica=2)) for mb in mbs]
    fresh = TokenBatches(tokens, seq_len=8, global_batch=6, dp=3, micro_batch=1, seed=9)
    fresh.load_state_dict(full.state_dict())
    resumed = [mb for _, (step, mbs) in zip(range(5), fresh.iterate(replica=2, start_step=7)) for mb in mbs]
    assert len(resumed) == 10
    for (x1, y1), (x2, y2) in zip(uninterrupted[14:], resumed):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    other = TokenBatches(tokens, seq_len=16, global_batch=6, dp=3)
    with pytest.raises(ValueError, match="seq_len"):
        other.load_state_dict(full.state_dict())


@pytest.mark.parametrize("dp,micro_batch", [(1, 16), (1, 4), (2, 2), (4, 1), (4, 4), (8, 2)])
def test_same_global_batch_whatever_dp_and_micro_batching(dp, micro_batch):
    tokens = small_tokens()
    reference = TokenBatches(tokens, seq_len=12, global_batch=16, seed=2)
    split = TokenBatches(tokens, seq_len=12, global_batch=16, dp=dp, micro_batch=micro_batch, seed=2)
    assert split.num_microbatches == 16 // dp // micro_batch
    for step in (0, 3):
        rx, ry = reference.global_batch(step)
        parts = [split.batch(step, r, m) for r in range(dp) for m in range(split.num_microbatches)]
        assert torch.equal(torch.cat([p[0] for p in parts]), rx) and torch.equal(torch.cat([p[1] for p in parts]), ry)
        for r in range(dp):
            rows = slice(r * 16 // dp, (r + 1) * 16 // dp)
            assert torch.equal(split.replica_batch(step, r)[0], rx[rows])
            mbs = split.micro_batches(step, r)
            assert torch.equal(torch.cat([m[0] for m in mbs]), rx[rows])


def test_bad_loader_settings_are_refused():
    tokens = small_tokens(100)
    with pytest.raises(ValueError, match="multiple of dp"):
        TokenBatches(tokens, seq_len=8, global_batch=6, dp=4)
    with pytest.raises(ValueError, match="micro_batch"):
        TokenBatches(tokens, seq_len=8, global_batch=8, dp=2, micro_batch=3)
    with pytest.raises(ValueError, match="shorter than one sequence"):
        TokenBatches(tokens, seq_len=200, global_batch=2)
    b = TokenBatches(tokens, seq_len=8, global_batch=4, dp=2, micro_batch=1)
    with pytest.raises(ValueError):
        b.batch(0, 2, 0)
    with pytest.raises(ValueError):
        b.batch(0, 0, 2)


def test_open_batches_on_the_builtin_corpus_feeds_the_tiny_model():
    from geotrain.models.presets import PRESETS

    tiny = PRESETS["tiny"]
    b = open_batches(None, seq_len=tiny.seq_len, global_batch=16, dp=2, micro_batch=2, seed=0)
    x, y = b.batch(0, 1, 3)
    assert x.shape == (2, tiny.seq_len) and int(x.max()) < tiny.vocab
    assert b.num_microbatches == 4 and b.steps_per_epoch > 1000
