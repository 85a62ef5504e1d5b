"""Training text tokenized once by a real tokenizer (tokenizer.json) into a memory-mapped file.

A BPE tokenizer is far slower than reading bytes, and every rank of every run would otherwise
tokenize the same files again; so the token ids are written once to
`$GEOTRAIN_CACHE_DIR` (default `~/.cache/geotrain/tokens`) under a name that hashes everything
they depend on -- the tokenizer.json's bytes, each file's path, size and modification time, the
byte cap and the JSONL field -- and are then opened with `numpy.memmap`: ranks on one host share
the page cache, and nothing but the windows read is loaded. The file is written to a temporary
name and renamed, so a rank never sees half a cache; two ranks that race both write the same
bytes. Documents are joined by the tokenizer's EOS token (or the text separator's tokens).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from geotrain.errors import GeotrainError

SEPARATOR = "\n\n"
_BATCH = 256


def cache_dir() -> Path:
    return Path(os.environ.get("GEOTRAIN_CACHE_DIR") or Path.home() / ".cache" / "geotrain" / "tokens")


def documents(files: list[Path], max_bytes: int, field: str = "text", skip_binary: bool = True) -> Iterator[str]:
    """The texts of `files`: a `.jsonl` file gives its lines' `field` strings (other lines are
    skipped), any other file its whole text; stops after about `max_bytes` of UTF-8."""
    total = 0
    for f in files:
        if total >= max_bytes:
            return
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if not data or (skip_binary and b"\x00" in data[:8192]):
            continue
        texts = jsonl_texts(data, field) if f.suffix == ".jsonl" else [data.decode("utf-8", "replace")]
        for t in texts:
            if total >= max_bytes:
                return
            t = t[: max_bytes - total]
            total += len(t.encode("utf-8", "replace"))
            yield t


def jsonl_texts(data: bytes, field: str = "text") -> list[str]:
    out = []
    for line in data.splitlines():
        try:
            doc = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get(field), str) and doc[field]:
            out.append(doc[field])
    return out


def _key(tokenizer, files: list[Path], max_bytes: int, field: str) -> str:
    h = hashlib.sha256(Path(tokenizer.path).read_bytes())
    h.update(json.dumps([max_bytes, field]).encode())
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def tokenize_files(files: list[Path], tokenizer, max_bytes: int, field: str = "text",
                   skip_binary: bool = True) -> np.ndarray:
    """Token ids of `files` (uint16 when the vocabulary allows, else uint32), read-only memmap."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    root = cache_dir()
    path = root / f"{_key(tokenizer, files, max_bytes, field)}.{np.dtype(dtype).name}"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        sep = [tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode(SEPARATOR)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tokens-")
        n = 0
        try:
            with os.fdopen(fd, "wb") as out:
                batch: list[str] = []
                for doc in documents(files, max_bytes, field, skip_binary):
                    batch.append(doc)
                    if len(batch) == _BATCH:
                        n += _write(out, tokenizer, batch, sep, dtype)
                        batch = []
                n += _write(out, tokenizer, batch, sep, dtype)
            if n == 0:
                raise GeotrainError("data: no text found")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return np.memmap(path, dtype=dtype, mode="r")


def _write(out, tokenizer, texts: list[str], sep: list[int], dtype) -> int:
    if not texts:
        return 0
    ids = [t + sep for t in tokenizer.encode_batch(texts)]
    flat = np.fromiter((i for doc in ids for i in doc), dtype=dtype)
    out.write(flat.tobytes())
    return int(flat.size)
