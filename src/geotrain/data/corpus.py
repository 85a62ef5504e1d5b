"""Training text as one flat array of byte tokens.

The built-in default needs no download: the Python standard library's own `.py` sources, found
next to the `os` module, read in sorted path order (so every process on a machine builds the
same array), without test suites and installed packages, capped at `max_bytes`. Users can give
plain-text files or directories instead.

The array is built once per process and cached: every rank and every loader reuses it, and the
build stays well under a second (a few hundred files, ~8 MB).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from geotrain.data.token_cache import jsonl_texts, tokenize_files
from geotrain.errors import GeotrainError

DEFAULT_MAX_BYTES = 8 * 2**20
BUILTIN = "stdlib"
# Directories of the standard library that are not the library itself (or are huge test data).
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3", "turtledemo"}
_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class Corpus:
    """Token ids (a read-only uint8 array of bytes, or a memory-mapped array of tokenizer ids)
    and where they came from."""

    tokens: np.ndarray
    files: tuple[str, ...]
    source: str

    def __len__(self) -> int:
        return int(self.tokens.size)

    def describe(self) -> str:
        return f"{self.source}: {len(self.files)} files, {len(self) / 2**20:.1f} MiB of byte tokens"


_CACHE: dict[tuple[str, int], Corpus] = {}


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


def _text_files(path: Path) -> list[Path]:
    """A file, or every non-hidden file under a directory, in sorted order."""
    if path.is_file():
        return [path]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        out += [Path(dirpath) / f for f in filenames if not f.startswith(".")]
    return sorted(out, key=lambda p: p.relative_to(path).as_posix())


def _looks_binary(head: bytes) -> bool:
    return b"\x00" in head


def _concat(files: list[Path], max_bytes: int, skip_binary: bool) -> tuple[np.ndarray, tuple[str, ...]]:
    chunks, used, total = [], [], 0
    for f in files:
        if total >= max_bytes:
            break
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if not data or (skip_binary and _looks_binary(data[:8192])):
            continue
        if f.suffix == ".jsonl":            # JSON lines: the documents are the lines' "text" fields
            data = _SEPARATOR.join(t.encode("utf-8", "replace") for t in jsonl_texts(data, "text"))
            if not data:
                continue
        piece = data + _SEPARATOR
        chunks.append(piece[: max_bytes - total])
        used.append(str(f))
        total += len(chunks[-1])
    arr = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return arr, tuple(used)


def load_corpus(source: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES, tokenizer=None) -> Corpus:
    """The built-in corpus (`source` None or "stdlib") or a user's text file / directory (plain
    text files, `.jsonl` files with a "text" field, or a directory of either).

    tokenizer: None for byte tokens (uint8, in memory); an `HFTokenizer` for its ids, tokenized
    once into a memory-mapped cache file (data.token_cache).
    Raises GeotrainError (one line, exit 2 from the CLI) for a missing path or empty text."""
    if max_bytes <= 0:
        raise ValueError("max_bytes must be positive")
    builtin = source is None or str(source) == BUILTIN
    key = (BUILTIN if builtin else str(Path(source).resolve()), max_bytes, str(getattr(tokenizer, "path", "")))
    if key in _CACHE:
        return _CACHE[key]
    if tokenizer is not None and hasattr(tokenizer, "path"):
        if not builtin and not Path(source).exists():
            raise GeotrainError(f"data: {source}: no such file or directory")
        files = stdlib_files() if builtin else _text_files(Path(source))
        tokens = tokenize_files(files, tokenizer, max_bytes, skip_binary=builtin or Path(source).is_dir())
        label = f"{'built-in corpus' if builtin else source} tokenized by {tokenizer.path}"
        corpus = Corpus(tokens=tokens, files=tuple(map(str, files)), source=label)
        _CACHE[key] = corpus
        return corpus
    if builtin:
        tokens, files = _concat(stdlib_files(), max_bytes, skip_binary=True)
        label = f"Python {'.'.join(map(str, __import__('sys').version_info[:2]))} standard library"
    else:
        path = Path(source)
        if not path.exists():
            raise GeotrainError(f"data: {path}: no such file or directory")
        files_in = _text_files(path)
        # A file named explicitly is used as given; inside a directory, binary files are skipped.
        tokens, files = _concat(files_in, max_bytes, skip_binary=path.is_dir())
        label = str(path)
    if tokens.size == 0:
        raise GeotrainError(f"data: {label}: no text found")
    tokens.flags.writeable = False
    corpus = Corpus(tokens=tokens, files=files, source=label)
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
