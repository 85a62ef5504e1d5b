"""Training data: a byte-level tokenizer, a built-in corpus that needs no download, and a
deterministic, resumable loader that gives each data-parallel replica its own shard.

Typical use (one DP replica of a pipeline run)::

    batches = open_batches(job.data, seq_len=model.seq_len, global_batch=job.global_batch,
                           dp=plan.dp, micro_batch=plan.micro_batch, seed=job.seed, spec_path=spec.path)
    inputs, targets = batches.batch(step, replica, mb)
"""

from __future__ import annotations

from pathlib import Path

from geotrain.data.corpus import BUILTIN, DEFAULT_MAX_BYTES, Corpus, load_corpus, resolve_data_path, stdlib_files
from geotrain.data.loader import Batch, TokenBatches
from geotrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "BUILTIN", "DEFAULT_MAX_BYTES", "Batch", "ByteTokenizer", "Corpus", "HFTokenizer", "TokenBatches", "load_tokenizer",
    "load_corpus", "open_batches", "resolve_data_path", "stdlib_files",
]


def open_batches(data: str | Path | None, *, seq_len: int, global_batch: int, dp: int = 1,
                 micro_batch: int | None = None, seed: int = 0, spec_path: Path | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, tokenizer=None) -> TokenBatches:
    """The loader for a job's `data` setting (None or "stdlib": the built-in corpus; a path is
    relative to the spec file when `spec_path` is given). tokenizer: None for bytes, or an
    HFTokenizer (see load_tokenizer)."""
    corpus = load_corpus(resolve_data_path(None if data is None else str(data), spec_path), max_bytes, tokenizer)
    return TokenBatches(corpus.tokens, seq_len=seq_len, global_batch=global_batch, dp=dp,
                        micro_batch=micro_batch, seed=seed)
