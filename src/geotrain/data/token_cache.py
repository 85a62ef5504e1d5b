"""A source's documents tokenized once into a memory-mapped file that every rank opens.

Tokenizing a real corpus takes minutes and every rank of every run would otherwise repeat it; so
the token ids are written once to `$GEOTRAIN_CACHE_DIR` (default `~/.cache/geotrain/tokens`)
under a name that hashes everything they depend on -- the tokenizer (`fingerprint`: the
tokenizer.json's bytes, chat template, BOS/EOS; or the byte tokenizer), the source's settings
and each file's relative path and CONTENTS (sha256; memoised per inode, size, mtime and ctime so
an unchanged corpus is not re-read at every launch) -- and then opened with `numpy.memmap`: ranks
on one host share the page cache and load only the windows they read. One process builds an
entry (a lock file; the others wait and open it), writing to a temporary name that is renamed
last, with the counts beside it (`<key>.json`). Tokenizing shows progress (bytes read, after
a second) and uses every core: the `tokenizers` library encodes each batch on all cores while
this thread reads and parses the next one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from geotrain.data.formats import DocumentReader, Reading
from geotrain.errors import GeotrainError

FORMAT_VERSION = 2           # bump when what the ids of a document are changes
_BATCH_CHARS = 4 << 20       # characters per batch handed to the tokenizer


def cache_dir() -> Path:
    return Path(os.environ.get("GEOTRAIN_CACHE_DIR") or Path.home() / ".cache" / "geotrain" / "tokens")


def content_hash(path: Path) -> str:
    """sha256 of a file's bytes, memoised in the cache folder by what changes when the file does."""
    st = path.stat()
    stamp = f"{path.resolve()}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    memo = cache_dir() / "hashes" / hashlib.sha256(stamp.encode()).hexdigest()[:32]
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(memo, digest.encode())
    return digest


def source_key(reading: Reading, root: Path | None, tokenizer, settings: dict) -> str:
    """The cache key of a source: tokenizer, settings and every file's relative path and contents."""
    files = [[str(f.relative_to(root)) if root is not None and f.is_relative_to(root) else f.name, content_hash(f)]
             for f in reading.files]
    doc = {"v": FORMAT_VERSION, "tokenizer": tokenizer.fingerprint, "settings": settings, "files": files}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _capped(docs: Iterator[str], max_bytes: int | None) -> Iterator[str]:
    """The documents, the last one cut so that at most `max_bytes` of UTF-8 are read in all."""
    total = 0
    for doc in docs:
        if max_bytes is not None:
            if total >= max_bytes:
                return
            raw = doc.encode("utf-8", "replace")
            if total + len(raw) > max_bytes:
                doc = raw[: max_bytes - total].decode("utf-8", "ignore")
            total += len(raw)
        yield doc


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= _BATCH_CHARS or len(batch) >= 8192:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenize_source(reading: Reading, reader: DocumentReader, tokenizer, *, root: Path | None, settings: dict,
                    label: str, max_bytes: int | None = None, progress: bool = True) -> tuple[np.ndarray, dict]:
    """(token ids, counts) of a source's documents: the cache entry, built first if missing.

    counts: {"documents", "tokens", "files": [FileStats dicts], "skipped_files"}."""
    root_dir = cache_dir()
    root_dir.mkdir(parents=True, exist_ok=True)
    key = source_key(reading, root, tokenizer, {**settings, "max_bytes": max_bytes})
    dtype = np.dtype(tokenizer.token_dtype)
    path, meta = root_dir / f"{key}.{dtype.name}", root_dir / f"{key}.json"
    if not path.exists():
        with open(root_dir / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)            # one builder; the others wait, then find it built
            if not path.exists():
                counts = _build(reading, reader, tokenizer, path, meta, label, max_bytes, progress)
                return np.memmap(path, dtype=dtype, mode="r"), counts
    try:
        counts = json.loads(meta.read_text())
    except (OSError, ValueError):
        counts = {}
    return np.memmap(path, dtype=dtype, mode="r"), counts


def _build(reading: Reading, reader: DocumentReader, tokenizer, path: Path, meta: Path, label: str,
           max_bytes: int | None, progress: bool) -> dict:
    total = sum(f.stat().st_size for f in reading.files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing {label}", file=sys.stderr, delay=1.0,
               disable=not progress, dynamic_ncols=True)
    reader.on_bytes = bar.update
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokens-")
    n = docs = 0
    try:
        with os.fdopen(fd, "wb") as out, ThreadPoolExecutor(1) as pool:
            pending = None
            for batch in _batches(_capped(reader.read(reading), max_bytes)):
                if pending is not None:        # encode this batch while the next one is read
                    n += _write(out, pending.result())
                pending = pool.submit(tokenizer.encode_documents, batch)
                docs += len(batch)
            if pending is not None:
                n += _write(out, pending.result())
        bar.close()
        if n == 0:
            raise GeotrainError(f"data: {label}: no text found")
        counts = {"documents": docs, "tokens": n, "files": [s.to_dict() for s in reading.stats],
                  "skipped_files": reading.skipped_files}
        _write_atomic(meta, json.dumps(counts).encode())
        os.replace(tmp, path)
        return counts
    finally:
        bar.close()
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write(out, ids: np.ndarray) -> int:
    out.write(ids.tobytes())
    return int(ids.size)
