"""Training documents read from files in every common format, or a one-line refusal naming the file.

A file's format is its extension, after a compression suffix is peeled off (.gz, .zst/.zstd, .xz,
.bz2: the text formats only; the compression itself is told by the file's magic bytes, and a
suffix the bytes contradict is refused):

  text (.txt, .md, source code, ...)  the whole file is one document
  .jsonl / .ndjson                    one record per line; the document is the record's `field`
  .json                               an array of records (or of strings); JSON Lines in a .json
                                      file are read as .jsonl, as Hugging Face `datasets` does
  .parquet                            the `field` column (pyarrow, one row group at a time)
  .arrow                              an Arrow IPC stream or file (what `datasets` writes)
  a folder                            a `datasets.save_to_disk` folder (state.json + data-*.arrow;
                                      dataset_dict.json: its `split`), else every file beneath it

A field whose value is a chat -- a list of {"role", "content"} messages -- is rendered with the
tokenizer's chat template (`HFTokenizer.apply_chat_template`), or refused where there is none.
A file of unknown type named on its own, a binary file, a field no record has, or a folder with
nothing readable is a `GeotrainError` naming the file: nothing is ever trained on as raw bytes.
Inside a folder, files of unknown type are left out and listed (`Reading.skipped_files`).
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from geotrain.errors import GeotrainError

TEXT_SUFFIXES = frozenset("""
txt text md markdown rst tex org adoc asciidoc html htm xml svg py pyi pyx c h cc cpp cxx hpp hh cu cuh
java kt kts scala groovy js mjs cjs ts tsx jsx go rs rb php pl pm lua swift m mm r jl sh bash zsh fish
ps1 sql css scss less yaml yml toml ini cfg conf hs ml mli ex exs erl hrl clj cljs dart vue svelte cs fs
vb asm s v sv vhd vhdl cmake proto graphql tf nim zig f f90 pas
""".split())
STRUCTURED = {"jsonl": "jsonl", "ndjson": "jsonl", "json": "json", "parquet": "parquet", "arrow": "arrow"}
COMPRESSIONS = {"gz": "gzip", "zst": "zstd", "zstd": "zstd", "xz": "xz", "bz2": "bzip2"}
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2"))
_BINARY_MAGIC = ((b"PAR1", "Parquet"), (b"ARROW1", "Arrow"), (b"PK\x03\x04", "zip"), (b"\x89PNG", "PNG"),
                 (b"%PDF", "PDF"), (b"\x7fELF", "ELF"))
_SNIFF = 8192

Chat = Callable[[list[dict]], str]


def _err(path: Path, why: str) -> GeotrainError:
    return GeotrainError(f"data: {path}: {why}")


def file_format(path: Path) -> tuple[str, str | None] | None:
    """(format, compression named by the suffix) of a file, or None for an unknown type."""
    parts = path.name.lower().split(".")[1:]
    comp = COMPRESSIONS.get(parts[-1]) if parts else None
    if comp:
        parts = parts[:-1]
    if not parts:
        return None
    ext = parts[-1]
    kind = STRUCTURED.get(ext) or ("text" if ext in TEXT_SUFFIXES else None)
    if kind is None or (comp and kind in ("parquet", "arrow")):
        return None
    return kind, comp


def sniff_compression(head: bytes) -> str | None:
    return next((name for magic, name in _MAGIC if head.startswith(magic)), None)


@dataclass
class FileStats:
    """What one file gave: its format, size, documents read and records left out."""

    path: str
    format: str
    bytes: int
    documents: int = 0
    skipped_records: int = 0     # lines / records that were not JSON objects or had no such field

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Reading:
    """The files a source resolved to, and what reading them gave (filled while iterating)."""

    files: list[Path]
    skipped_files: list[str] = field(default_factory=list)
    stats: list[FileStats] = field(default_factory=list)
    hf_dataset: bool = False


class _Counting(io.RawIOBase):
    """A binary file that counts the bytes read from it (the progress of a compressed read)."""

    def __init__(self, f):
        self.f, self.n = f, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        k = self.f.readinto(b)
        self.n += k or 0
        return k

    def close(self) -> None:
        self.f.close()
        super().close()


def _open(path: Path, comp: str | None, counter: list) -> io.BufferedIOBase:
    """The file's decompressed bytes; `counter[0]` becomes the raw stream (for progress)."""
    with open(path, "rb") as f:
        actual = sniff_compression(f.read(8))
    if comp and actual != comp:
        raise _err(path, f"not {comp} data (named {path.suffix}; its bytes are "
                         f"{actual + ' data' if actual else 'uncompressed'})")
    raw = _Counting(open(path, "rb"))  # noqa: SIM115 -- the caller closes the returned stream
    counter[0] = raw
    buffered = io.BufferedReader(raw, 1 << 20)
    if actual == "gzip":
        return gzip.GzipFile(fileobj=buffered)
    if actual == "xz":
        return lzma.LZMAFile(buffered)
    if actual == "bzip2":
        return bz2.BZ2File(buffered)
    if actual == "zstd":
        # lazy: zstandard only for .zst files
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(buffered), 1 << 20)
    return buffered


def _check_text(path: Path, head: bytes) -> None:
    kind = next((name for magic, name in _BINARY_MAGIC if head.startswith(magic)), None)
    if kind or b"\x00" in head:
        raise _err(path, f"binary data ({kind or 'NUL bytes'}), not text; "
                         "give text, JSONL, JSON, Parquet, Arrow or a datasets folder")


def _damaged(e: Exception) -> bool:
    """Whether an exception from reading a file means its bytes are bad (not a bug of ours)."""
    names = {type(c).__name__ for c in type(e).__mro__}
    return isinstance(e, (OSError, EOFError, zlib.error, lzma.LZMAError, UnicodeError)) or bool(
        names & {"ZstdError", "ArrowException", "ArrowInvalid"})


def _is_chat(v: object) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(m, dict) and "role" in m and "content" in m for m in v)


class DocumentReader:
    """Documents of one source's files, in order. `field`: the record field (or column) with the
    text; `chat`: renders a list of messages (None: chats are refused); `on_bytes(n)`: called with
    the raw bytes consumed since the last call (progress)."""

    def __init__(self, field: str = "text", chat: Chat | None = None,
                 on_bytes: Callable[[int], None] | None = None):
        self.field, self.chat, self.on_bytes = field, chat, on_bytes or (lambda n: None)
        self._keys: set[str] = set()        # fields of records left out (named when none had `field`)

    def read(self, reading: Reading) -> Iterator[str]:
        for f in reading.files:
            fmt = "arrow" if reading.hf_dataset else file_format(f)[0]   # type: ignore[index]
            st = FileStats(str(f), fmt, f.stat().st_size)
            reading.stats.append(st)
            self._keys.clear()
            try:
                yield from getattr(self, f"_{fmt}")(f, st)
            except GeotrainError:
                raise
            except Exception as e:  # noqa: BLE001 -- gzip, lzma, bz2, zlib, zstandard, pyarrow: each its own type
                if not _damaged(e):
                    raise
                raise _err(f, f"damaged or truncated data ({type(e).__name__}: {' '.join(str(e).split())[:100]})"
                           ) from None
            if st.documents == 0:
                raise _err(f, self._nothing(st))

    def _nothing(self, st: FileStats) -> str:
        if st.format == "text":
            return "empty file"
        if st.skipped_records:
            seen = f"; fields seen: {', '.join(sorted(self._keys))[:120]}" if self._keys else ""
            return (f"no record has a text or chat field {self.field!r} ({st.skipped_records} records{seen}); "
                    "set the source's field (e.g. [[job.data]] path = ..., field = \"content\")")
        return "no records"

    def _text_of(self, path: Path, st: FileStats, value: object) -> str | None:
        if isinstance(value, str):
            return value or None
        if _is_chat(value):
            if self.chat is None:
                raise _err(path, f"field {self.field!r} holds chat messages but the tokenizer has no chat "
                                 "template (train a model directory whose tokenizer_config.json has one)")
            return self.chat(value)  # type: ignore[arg-type]
        return None

    def _record(self, path: Path, st: FileStats, rec: object) -> str | None:
        if isinstance(rec, str) and self.field == "text":        # a JSON array of plain strings
            text = rec or None
        else:
            text = self._text_of(path, st, rec.get(self.field)) if isinstance(rec, dict) else None
        if text is None:
            st.skipped_records += 1
            if isinstance(rec, dict) and len(self._keys) < 50:
                self._keys.update(map(str, rec))
        else:
            st.documents += 1
        return text

    # -- the formats -----------------------------------------------------------------------------
    def _text(self, path: Path, st: FileStats) -> Iterator[str]:
        counter: list = [None]
        with _open(path, file_format(path)[1], counter) as f:   # type: ignore[index]
            data = f.read()
        self.on_bytes(counter[0].n)
        _check_text(path, data[:_SNIFF])
        if data:
            st.documents += 1
            yield data.decode("utf-8", "replace")

    def _jsonl(self, path: Path, st: FileStats) -> Iterator[str]:
        counter: list = [None]
        with _open(path, file_format(path)[1], counter) as f:   # type: ignore[index]
            head = f.peek(_SNIFF)[:_SNIFF] if hasattr(f, "peek") else b""
            _check_text(path, head)
            seen = 0
            for line in f:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except (ValueError, RecursionError):
                    st.skipped_records += 1
                    continue
                text = self._record(path, st, rec)
                if text is not None:
                    yield text
                if counter[0].n - seen > 1 << 20:
                    self.on_bytes(counter[0].n - seen)
                    seen = counter[0].n
            self.on_bytes(counter[0].n - seen)

    def _json(self, path: Path, st: FileStats) -> Iterator[str]:
        counter: list = [None]
        with _open(path, file_format(path)[1], counter) as f:   # type: ignore[index]
            data = f.read()
        _check_text(path, data[:_SNIFF])
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as e:
            first = data.lstrip()[:1]
            if first == b"{" and b"\n" in data.strip():        # JSON Lines in a .json file
                yield from self._jsonl(path, st)
                return
            raise _err(path, f"not valid JSON ({' '.join(str(e).split())[:80]})") from None
        self.on_bytes(counter[0].n)
        if isinstance(doc, dict):
            if self._text_of(path, st, doc.get(self.field)) is not None:   # a single record
                doc = [doc]
            else:
                raise _err(path, "a JSON object, not an array of records (JSON Lines? name it .jsonl)")
        if not isinstance(doc, list):
            raise _err(path, f"a JSON {type(doc).__name__}, not an array of records")
        for rec in doc:
            text = self._record(path, st, rec)
            if text is not None:
                yield text

    def _columns(self, path: Path, st: FileStats, schema, batches, rows: int | None) -> Iterator[str]:
        # lazy: pyarrow only for Parquet and Arrow data
        import pyarrow as pa

        if self.field not in schema.names:
            raise _err(path, f"no column {self.field!r} (columns: {', '.join(schema.names)[:200]}); "
                             "set the source's field")
        typ = schema.field(self.field).type
        text = pa.types.is_string(typ) or pa.types.is_large_string(typ) or getattr(pa.types, "is_string_view",
                                                                                 lambda t: False)(typ)
        chat = ((pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_struct(typ.value_type)
                and {"role", "content"} <= {f.name for f in typ.value_type})
        if not (text or chat):
            raise _err(path, f"column {self.field!r} is {typ}, not text or chat messages")
        done = 0
        for batch in batches:
            for value in batch.column(self.field).to_pylist():
                doc = self._record(path, st, {self.field: value})
                if doc is not None:
                    yield doc
            if rows:
                part = st.bytes * batch.num_rows // rows
                self.on_bytes(part)
                done += part
        self.on_bytes(max(0, st.bytes - done))

    def _parquet(self, path: Path, st: FileStats) -> Iterator[str]:
        # lazy: pyarrow only for Parquet and Arrow data
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise _err(path, f"not a Parquet file ({' '.join(str(e).split())[:100]})") from None
        columns = [self.field] if self.field in pf.schema_arrow.names else None
        yield from self._columns(path, st, pf.schema_arrow, pf.iter_batches(columns=columns, batch_size=4096),
                                 pf.metadata.num_rows)

    def _arrow(self, path: Path, st: FileStats) -> Iterator[str]:
        # lazy: pyarrow only for Parquet and Arrow data
        import pyarrow as pa
        import pyarrow.ipc as ipc

        source = pa.memory_map(str(path))
        try:
            try:
                reader = ipc.open_stream(source)
                batches, rows = iter(reader), None
            except pa.ArrowInvalid:
                reader = ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
                rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        except (pa.ArrowException, OSError) as e:
            raise _err(path, f"not an Arrow IPC file ({' '.join(str(e).split())[:100]})") from None
        try:
            yield from self._columns(path, st, reader.schema, batches, rows)
        except pa.ArrowException as e:
            raise _err(path, f"a damaged Arrow file ({' '.join(str(e).split())[:100]})") from None


def resolve(path: Path, split: str = "train") -> Reading:
    """The files of a source path, in the order read. Raises GeotrainError naming the path when it
    is missing, of an unknown type, or a folder with nothing readable."""
    if not path.exists():
        raise _err(path, "no such file or directory")
    if path.is_file():
        if file_format(path) is None:
            raise _err(path, "unknown file type; give text (.txt, .md, source code), .jsonl, .json, .parquet, "
                             ".arrow or a datasets folder, optionally .gz / .zst / .xz / .bz2 compressed")
        return Reading([path])
    if (path / "dataset_dict.json").is_file():                 # datasets.DatasetDict.save_to_disk
        try:
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        except (OSError, ValueError, AttributeError):
            raise _err(path / "dataset_dict.json", "not a datasets dataset_dict.json") from None
        if split not in splits:
            raise _err(path, f"no split {split!r} (splits: {', '.join(map(str, splits))}); set the source's split")
        return resolve(path / split, split)
    if (path / "state.json").is_file() and any(path.glob("*.arrow")):   # datasets.Dataset.save_to_disk
        try:
            names = [d["filename"] for d in json.loads((path / "state.json").read_text())["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError):
            raise _err(path / "state.json", "not a datasets state.json (no _data_files)") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise _err(path / missing[0], "listed in state.json but missing")
        return Reading([path / n for n in names], hf_dataset=True)
    files, skipped = [], []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if f.startswith("."):
                continue
            p = Path(dirpath) / f
            (files if file_format(p) is not None else skipped).append(p)
    files.sort(key=lambda p: p.relative_to(path).as_posix())
    if not files:
        listed = ", ".join(str(p.relative_to(path)) for p in skipped[:5]) + (" ..." if len(skipped) > 5 else "")
        raise _err(path, "no readable files" + (f" (of unknown type: {listed})" if skipped else " (empty folder)"))
    return Reading(files, skipped_files=[str(p) for p in skipped])
