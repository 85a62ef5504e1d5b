"""Training text as one flat array of token ids per source.

The built-in default needs no download: the Python standard library's own `.py` sources, found
next to the `os` module, read in sorted path order (so every process on a machine builds the
same array), without test suites and installed packages, each file one document, capped at
`max_bytes` (the built-in corpus's own cap; a user's data has none). Users give files or folders
in any format `formats` reads; they are tokenized once into the token cache (`token_cache`),
with the byte tokenizer as with a model's tokenizer.json.

A corpus is built once per process and cached: every rank and every loader reuses it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from geotrain.data.formats import DocumentReader, Reading, resolve
from geotrain.data.token_cache import tokenize_source
from geotrain.data.tokenizer import ByteTokenizer
from geotrain.errors import GeotrainError

DEFAULT_MAX_BYTES = 8 * 2**20
BUILTIN = "stdlib"
# Directories of the standard library that are not the library itself (or are huge test data).
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3", "turtledemo"}


@dataclass(frozen=True)
class Corpus:
    """Token ids (a read-only array: bytes, or a tokenizer's ids) and where they came from."""

    tokens: np.ndarray
    files: tuple[str, ...]
    source: str
    documents: int = 0
    counts: dict = field(default_factory=dict)      # per-file counts and files left out (token_cache)

    def __len__(self) -> int:
        return int(self.tokens.size)

    def describe(self) -> str:
        skipped = len(self.counts.get("skipped_files") or [])
        return (f"{self.source}: {len(self.files)} files, {self.documents:,} documents, {len(self):,} tokens"
                + (f" ({skipped} files of unknown type left out)" if skipped else ""))


_CACHE: dict[tuple, Corpus] = {}


def stdlib_root() -> Path:
    """The directory holding the standard library's pure-Python modules."""
    return Path(os.__file__).resolve().parent


def stdlib_files() -> list[Path]:
    root = stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _builtin_bytes(max_bytes: int) -> tuple[np.ndarray, tuple[str, ...], int]:
    """The built-in corpus in byte tokens, in memory: each file's bytes and a NUL, up to the cap."""
    chunks, used, total = [], [], 0
    for f in stdlib_files():
        if total >= max_bytes:
            break
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if not data or b"\x00" in data[:8192]:
            continue
        piece = (data + b"\x00")[: max_bytes - total]
        chunks.append(piece)
        used.append(str(f))
        total += len(piece)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8), tuple(used), len(used)


def chat_renderer(tokenizer):
    """How a chat's messages become training text: the tokenizer's chat template (None: refused)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    return lambda messages: tokenizer.apply_chat_template(messages, add_generation_prompt=False)


def load_corpus(source: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES, tokenizer=None, *,
                field: str = "text", split: str = "train", progress: bool = True) -> Corpus:
    """The built-in corpus (`source` None or "stdlib", capped at `max_bytes`) or a user's file or
    folder (`formats`: text, JSONL, JSON, Parquet, Arrow, datasets folders, compressed text), read
    whole. tokenizer: None for bytes, or an `HFTokenizer` (see load_tokenizer).
    Raises GeotrainError (one line, exit 2 from the CLI) for data that cannot be read right."""
    if max_bytes <= 0:
        raise ValueError("max_bytes must be positive")
    tokenizer = tokenizer or ByteTokenizer()
    builtin = source is None or str(source) == BUILTIN
    key = (BUILTIN if builtin else str(Path(source).resolve()), max_bytes if builtin else None,
           tokenizer.fingerprint, field, split)
    if key in _CACHE:
        return _CACHE[key]
    reader = DocumentReader(field, chat_renderer(tokenizer))
    if builtin and isinstance(tokenizer, ByteTokenizer):
        tokens, files, docs = _builtin_bytes(max_bytes)
        corpus = Corpus(tokens, files, f"Python {'.'.join(map(str, sys.version_info[:2]))} standard library", docs)
    elif builtin:
        reading = Reading(stdlib_files())
        tokens, counts = tokenize_source(reading, reader, tokenizer, root=stdlib_root(), settings={"builtin": 1},
                                         label="built-in corpus", max_bytes=max_bytes, progress=progress)
        corpus = Corpus(tokens, tuple(f["path"] for f in counts.get("files", [])),
                        f"built-in corpus tokenized by {tokenizer.path}", counts.get("documents", 0), counts)
    else:
        path = Path(source)
        reading = resolve(path, split)
        root = path if path.is_dir() else path.parent
        tokens, counts = tokenize_source(reading, reader, tokenizer, root=root,
                                         settings={"field": field, "split": split}, label=str(path),
                                         progress=progress)
        corpus = Corpus(tokens, tuple(map(str, reading.files)), str(path), counts.get("documents", 0), counts)
    if corpus.tokens.size == 0:
        raise GeotrainError(f"data: {corpus.source}: no text found")
    if isinstance(corpus.tokens, np.ndarray) and not isinstance(corpus.tokens, np.memmap):
        corpus.tokens.flags.writeable = False
    _CACHE[key] = corpus
    return corpus


def resolve_data_path(data: str | None, spec_path: Path | None) -> str | Path | None:
    """Where a job's `data = "..."` points: None / "stdlib" is the built-in corpus; a relative
    path is taken relative to the spec file (as `cluster` and `model` paths are), falling back
    to the working directory."""
    if data is None or data == BUILTIN:
        return None
    p = Path(data).expanduser()
    if not p.is_absolute() and spec_path is not None and (spec_path.parent / p).exists():
        return spec_path.parent / p
    return p
