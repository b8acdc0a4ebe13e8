"""Preparing a source once into a cached token file, and splitting it for training.

`load_dataset` is the entry point. It resolves the source (None: the built-in
standard-library corpus; a text file or folder; or a ready token file), tokenizes it
once into `cache_dir`, memory-maps the result and splits off a validation tail.

Concurrency: `prepare_tokens` is idempotent and atomic, so every rank of a job may call
`load_dataset` at the same time without any coordination. The cache file's name is a
hash of everything that determines its content (the source files' paths, sizes and
mtimes, the byte budget, the tokenizer name); a rank that finds it present reads it,
and ranks that miss it each write a private temporary file and `os.replace` it into
place, so readers only ever see a complete file. The cost of a simultaneous miss is
duplicated CPU work, not corruption. A trainer that wants to avoid even that can let
rank 0 call `load_dataset` first and barrier before the others do; this module does not
import torch.distributed to do so itself.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from partita.data.corpus import DEFAULT_STDLIB_BYTES, Corpus, stdlib_corpus, text_corpus
from partita.data.sampler import BatchSampler, eval_batches
from partita.data.tokenfile import TokenFileWriter, is_token_file, read_token_file
from partita.data.tokenizer import ByteTokenizer, Tokenizer
from partita.errors import PartitaError


def cache_path(corpus: Corpus, tokenizer: Tokenizer, cache_dir: str | os.PathLike) -> Path:
    """Where the token file for `corpus` under `tokenizer` lives in `cache_dir`."""
    key = hashlib.sha256(
        f"{corpus.fingerprint()}|{tokenizer.name}|{tokenizer.vocab_size}".encode()
    ).hexdigest()[:16]
    label = "".join(c if c.isalnum() or c in "-_" else "_" for c in corpus.name)[:40]
    return Path(cache_dir) / f"{label}-{key}.tok"


def prepare_tokens(corpus: Corpus, tokenizer: Tokenizer, cache_dir: str | os.PathLike) -> Path:
    """Tokenize `corpus` into its cache file unless present; return the file's path.

    Idempotent and atomic (see the module docstring): safe to call from many
    processes at once. Documents are concatenated with no separator token: the byte
    tokenizer has none, and source files already end with a newline.
    """
    path = cache_path(corpus, tokenizer, cache_dir)
    if path.exists():
        return path
    try:
        with TokenFileWriter(path, tokenizer.vocab_size) as out:
            for text in corpus.documents():
                out.write(tokenizer.encode(text))
    except OSError as e:
        raise PartitaError(f"Cannot write the token cache '{path}': {e.strerror or e}. Pass a "
                           "cache folder that exists or can be created and is writable, "
                           "with room for about one byte per source byte.") from e
    return path


@dataclass(frozen=True)
class TokenDataset:
    """A memory-mapped token stream split into a training part and a validation tail."""

    path: Path
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    seq_len: int
    tokenizer: Tokenizer | None  # None for a supplied token file: its tokenizer is unknown

    @property
    def num_tokens(self) -> int:
        return len(self.train) + len(self.val)

    def train_sampler(self, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
                      seed: int = 0) -> BatchSampler:
        """The resumable sampler of training batches for one data-parallel replica."""
        return BatchSampler(self.train, self.seq_len, global_batch, dp_rank, dp_size, seed)

    def val_batches(self, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
                    max_batches: int | None = None) -> list:
        """Fixed validation batches (the first windows of the tail, in order)."""
        return eval_batches(self.val, self.seq_len, global_batch, dp_rank, dp_size, max_batches)


def split_tokens(tokens: np.ndarray, seq_len: int, val_fraction: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): val is the last ceil(fraction * N) tokens, at least one window of
    seq_len + 1 (none when fraction is 0); train must keep at least one window."""
    if not 0.0 <= val_fraction < 1.0:
        raise PartitaError(f"val_fraction must be in [0, 1), got {val_fraction}. Use e.g. "
                           "0.01 to hold out the last 1% of tokens, or 0 for no validation.")
    n = len(tokens)
    n_val = 0 if val_fraction == 0 else max(math.ceil(val_fraction * n), seq_len + 1)
    if n - n_val < seq_len + 1:
        raise PartitaError(f"The data has {n} tokens, too few for seq_len {seq_len}: training "
                           f"needs at least {seq_len + 1} tokens after holding out {n_val} for "
                           "validation. Use more data (or a larger byte budget), a shorter "
                           "seq_len, or a smaller val_fraction.")
    return tokens[: n - n_val], tokens[n - n_val:]


def load_dataset(source: str | os.PathLike | None, cache_dir: str | os.PathLike,
                 seq_len: int, *, val_fraction: float = 0.01,
                 tokenizer: Tokenizer | None = None,
                 max_bytes: int | None = None) -> TokenDataset:
    """Prepare (once) and open a dataset.

    source: None for the built-in standard-library corpus (capped at `max_bytes`,
    default 8 MiB); a text file or folder of text files (capped at `max_bytes` when
    given); or a partita token file, used in place without copying.
    tokenizer: defaults to the byte tokenizer; ignored for a token file.
    The dataset's `vocab_size` comes from the token file header.
    """
    if seq_len < 1:
        raise PartitaError(f"seq_len must be at least 1, got {seq_len}.")
    if max_bytes is not None and max_bytes <= 0:
        raise PartitaError(f"max_bytes must be positive (or None), got {max_bytes}.")
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    if source is not None and is_token_file(source):
        path, tok = Path(source), None
    else:
        if source is None:
            corpus = stdlib_corpus(max_bytes if max_bytes is not None else DEFAULT_STDLIB_BYTES)
        else:
            corpus = text_corpus(source, max_bytes)
        path = prepare_tokens(corpus, tok, cache_dir)
    tokens, vocab_size = read_token_file(path)
    if tok is not None and vocab_size != tok.vocab_size:
        raise PartitaError(f"Token cache '{path}' has vocab size {vocab_size} but tokenizer "
                           f"'{tok.name}' has {tok.vocab_size}; the cache is stale or corrupt. "
                           "Delete it and run again.")
    train, val = split_tokens(tokens, seq_len, val_fraction)
    return TokenDataset(path, train, val, vocab_size, seq_len, tok)
