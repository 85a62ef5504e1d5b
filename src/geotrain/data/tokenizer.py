"""A byte-level tokenizer: token id = byte value, vocabulary of 256.

No merges and no vocabulary file: any text (any language, any source code) encodes losslessly,
nothing needs downloading, and a tiny model's embedding table stays 256 rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class ByteTokenizer:
    vocab_size = 256

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
