"""Tokenizers: the small protocol the data pipeline needs, and the byte-level default.

The byte tokenizer maps UTF-8 bytes to ids 0..255. It needs no vocabulary file and
no training, so the built-in corpus works on any machine; a learned tokenizer
(BPE, ...) can be plugged in later by implementing `Tokenizer`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer.

    `name` must change whenever the mapping text -> ids changes: it is part of the
    cache key of prepared token files.
    """

    name: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`, as a 1-d integer array (every id < vocab_size)."""
        ...

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of `ids`; undecodable pieces become U+FFFD, never an exception."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte (vocab 256)."""

    name = "bytes-utf8"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        # surrogatepass keeps lone surrogates (which can appear in str read with
        # errors="surrogateescape") from aborting a whole corpus preparation.
        return np.frombuffer(text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"byte token ids must lie in [0, 256), got {arr.min()}..{arr.max()}")
        # A window may start or end inside a multi-byte character: replace, don't fail.
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"
