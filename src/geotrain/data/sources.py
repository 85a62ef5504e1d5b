"""A job's data: its sources opened as corpora and mixed into one loader, and what they hold.

`open_batches` turns a job's `data` (None / "stdlib": the built-in corpus; a path; or sources
with weights, fields and splits -- spec.job.DataSource) into a `TokenBatches`; `data_report`
says what a run of so many steps covers: per source its files, documents, tokens, weight and
epochs (RUN_DIR/data.json and the console line).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from geotrain.data.corpus import DEFAULT_MAX_BYTES, Corpus, load_corpus, resolve_data_path
from geotrain.data.loader import TokenBatches


def _sources(data: Any, spec_path: Path | None) -> list[tuple[str | Path | None, float, str, str]]:
    """(path or None for the built-in corpus, weight, field, split) of each source."""
    if data is None or isinstance(data, (str, Path)):
        return [(resolve_data_path(None if data is None else str(data), spec_path), 1.0, "text", "train")]
    return [(resolve_data_path(s.path, spec_path), s.weight, s.field, s.split) for s in data]


def open_batches(data: Any, *, seq_len: int, global_batch: int, dp: int = 1, micro_batch: int | None = None,
                 seed: int = 0, spec_path: Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES, tokenizer=None,
                 holdout: float = 0.0, progress: bool = True) -> TokenBatches:
    """The loader for a job's `data` (see the module docstring; a relative path is relative to the
    spec file when `spec_path` is given). tokenizer: None for bytes, or an HFTokenizer (see
    load_tokenizer). `max_bytes` caps the built-in corpus only. The corpora are kept on the
    loader (`batches.corpora`) for `data_report`."""
    sources = _sources(data, spec_path)
    corpora = [load_corpus(path, max_bytes, tokenizer, field=field, split=split, progress=progress)
               for path, _, field, split in sources]
    batches = TokenBatches([c.tokens for c in corpora], seq_len=seq_len, global_batch=global_batch, dp=dp,
                           micro_batch=micro_batch, seed=seed, weights=[w for _, w, _, _ in sources],
                           holdout=holdout)
    batches.corpora = corpora
    return batches


def data_report(batches: TokenBatches, steps: int) -> dict[str, Any]:
    """What the data holds and what `steps` steps of it cover (RUN_DIR/data.json)."""
    corpora: list[Corpus] = getattr(batches, "corpora", [])
    epochs = batches.epochs(steps)
    total_w = sum(batches.weights)
    rows = []
    for i, c in enumerate(corpora):
        rows.append({"source": c.source, "weight": batches.weights[i] / total_w, "files": len(c.files),
                     "documents": c.documents, "tokens": len(c), "train_windows": batches.source_windows[i],
                     "held_out_windows": batches.held_out[i], "epochs": epochs[i],
                     "file_counts": c.counts.get("files", []), "skipped_files": c.counts.get("skipped_files", [])})
    return {"seq_len": batches.seq_len, "global_batch": batches.global_batch_size, "steps": steps,
            "tokens_trained": steps * batches.global_batch_size * batches.seq_len,
            "documents": sum(r["documents"] for r in rows), "tokens": sum(r["tokens"] for r in rows),
            "files": sum(r["files"] for r in rows), "sources": rows}


def describe_data(report: dict[str, Any]) -> str:
    """One console line for `data_report`'s output."""
    parts = []
    for r in report["sources"]:
        share = f"{100 * r['weight']:.0f}% " if len(report["sources"]) > 1 else ""
        skipped = f", {len(r['skipped_files'])} files of unknown type left out" if r["skipped_files"] else ""
        parts.append(f"{share}{r['source']}: {r['files']:,} files, {r['documents']:,} documents, "
                     f"{r['tokens']:,} tokens, {r['epochs']:.3g} epochs{skipped}")
    return "data: " + "; ".join(parts)
