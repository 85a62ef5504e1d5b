"""Training data: tokenizers (bytes, or a model's tokenizer.json), documents read from every common
format (`formats`), a token cache, a built-in corpus that needs no download, and a deterministic,
resumable loader that gives each data-parallel replica its own shard and mixes weighted sources.

Typical use (one DP replica of a pipeline run)::

    batches = open_batches(job.data, seq_len=model.seq_len, global_batch=job.global_batch,
                           dp=plan.dp, micro_batch=plan.micro_batch, seed=job.seed, spec_path=spec.path)
    inputs, targets = batches.batch(step, replica, mb)
"""

from __future__ import annotations

from geotrain.data.corpus import BUILTIN, DEFAULT_MAX_BYTES, Corpus, load_corpus, resolve_data_path, stdlib_files
from geotrain.data.loader import Batch, TokenBatches
from geotrain.data.sources import data_report, describe_data, open_batches
from geotrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "BUILTIN", "DEFAULT_MAX_BYTES", "Batch", "ByteTokenizer", "Corpus", "HFTokenizer", "TokenBatches", "data_report",
    "describe_data", "load_corpus", "load_tokenizer", "open_batches", "resolve_data_path", "stdlib_files",
]
