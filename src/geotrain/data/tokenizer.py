"""Tokenizers: the built-in byte-level one (token id = byte value, vocabulary of 256), and a
Hugging Face `tokenizer.json` through the `tokenizers` library (`HFTokenizer`, `load_tokenizer`).

The byte tokenizer:

No merges and no vocabulary file: any text (any language, any source code) encodes losslessly,
nothing needs downloading, and a tiny model's embedding table stays 256 rows. Its end of
document is byte 0 (NUL): no text holds it (a file with NUL bytes is refused as binary).

`encode_documents(texts)` is what training data is made of: each document's ids framed by the
tokenizer's BOS (when it has one, and the text does not already start with it, as a rendered
chat template does) and EOS (unless it already ends with it) -- or, for a tokenizer with
neither, followed by the ids of a blank line -- as one flat array of `token_dtype`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ByteTokenizer:
    vocab_size = 256
    eos_id = 0                  # NUL ends a document
    bos_id = None
    chat_template = None
    token_dtype = np.uint8
    fingerprint = "bytes, NUL-separated"

    def encode_documents(self, texts: list[str]) -> np.ndarray:
        """The documents' UTF-8 bytes, each followed by NUL."""
        return np.frombuffer(b"".join(t.encode("utf-8", "replace") + b"\0" for t in texts), dtype=np.uint8)

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text` as token ids."""
        return list(text.encode("utf-8"))

    def encode_array(self, data: str | bytes) -> np.ndarray:
        """Token ids as a uint8 array (what the corpus holds; one byte per token)."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        return np.frombuffer(raw, dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        """Text from token ids; a sequence cut inside a multi-byte character decodes with U+FFFD
        instead of failing, since sampled or sliced ids need not end on a character boundary."""
        if hasattr(ids, "tolist"):  # torch tensors and numpy arrays
            ids = ids.tolist()
        ids = list(ids)
        bad = [i for i in ids if not 0 <= int(i) < 256]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the byte vocabulary 0..255")
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer.json (a Hugging Face model directory's), with the EOS token and
    chat template of its tokenizer_config.json when present."""

    def __init__(self, directory: str | Path):
        # lazy: tokenizers only when called (importers that never call it stay free of it)
        from tokenizers import Tokenizer

        directory = Path(directory)
        self.path = directory / "tokenizer.json"
        try:
            self.tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 -- the library raises its own Exception type
            raise ValueError(f"{self.path}: not a tokenizer.json ({' '.join(str(e).split())[:120]})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        conf = {}
        if (directory / "tokenizer_config.json").is_file():
            try:
                conf = json.loads((directory / "tokenizer_config.json").read_text())
            except (OSError, ValueError):
                conf = {}
        self.chat_template = conf.get("chat_template") if isinstance(conf.get("chat_template"), str) else None
        eos = conf.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token = eos if isinstance(eos, str) else None
        self.eos_id = self.tok.token_to_id(eos) if isinstance(eos, str) else None
        bos = conf.get("bos_token")
        self.bos_token = (bos.get("content") if isinstance(bos, dict) else bos) or ""
        self.bos_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        self.token_dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        # What the token ids depend on (the cache key of tokenized data).
        h = hashlib.sha256(self.path.read_bytes())
        h.update(repr((self.chat_template, self.bos_token, self.eos_token)).encode())
        self.fingerprint = "tokenizer.json " + h.hexdigest()
        self._sep = [] if self.bos_id is not None or self.eos_id is not None else self.encode("\n\n")

    def encode(self, text: str) -> list[int]:
        text.encode("utf-8")            # a lone surrogate is the caller's error, as with bytes
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode_documents(self, texts: list[str]) -> np.ndarray:
        """Each document's ids between BOS and EOS (see the module docstring), flat."""
        if not texts:
            return np.zeros(0, dtype=self.token_dtype)
        parts = []
        bos = [self.bos_id] if self.bos_id is not None else []
        eos = [self.eos_id] if self.eos_id is not None else self._sep
        for text, ids in zip(texts, self.encode_batch(texts)):
            head = [] if self.bos_token and text.startswith(self.bos_token) else bos
            tail = [] if self.eos_token and eos and text.endswith(self.eos_token) else eos
            parts.append(np.asarray(head + ids + tail, dtype=self.token_dtype))
        return np.concatenate(parts)

    def decode(self, ids: Iterable[int]) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The text of a chat, rendered as transformers does (sandboxed Jinja): a prompt that asks for
        the assistant's turn, or (add_generation_prompt False) a whole conversation to train on."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
            eos_token=self.eos_token or "")


def load_tokenizer(model_dir: str | Path | None):
    """The model directory's tokenizer.json when it has one, else the byte tokenizer."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return HFTokenizer(model_dir)
    return ByteTokenizer()
