"""Preparing a source once into a cached token file, and splitting it for training.

`load_dataset` is the entry point. It resolves the source (None: the built-in
standard-library corpus; a text file or folder; or a ready token file), tokenizes it
once into `cache_dir`, memory-maps the result and splits off a validation tail.

Concurrency: `prepare_tokens` is idempotent and atomic, so every rank of a job may call
`load_dataset` at the same time without any coordination. The cache file's name is a
hash of everything that determines its content (the source files' paths, sizes and
mtimes -- not their bytes, which would mean reading every source on every start -- the
byte budget, a record source's text field and bad_lines policy, the tokenizer name,
and how documents are framed: BOS / EOS ids and the separator between records, see
`framing`); a rank that finds it present reads it,
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
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from partita.data.corpus import DEFAULT_STDLIB_BYTES, Corpus, stdlib_corpus, text_corpus
from partita.data.sampler import BatchSampler, too_few_windows
from partita.data.tokenfile import TokenFileWriter, is_token_file, read_token_file
from partita.data.tokenizer import ByteTokenizer, Tokenizer
from partita.errors import PartitaError
from partita.models.documents import DocumentStart

RECORD_SEPARATOR = "\n"


def framing(corpus, tokenizer: Tokenizer) -> tuple[int | None, int | None, str]:
    """(BOS id, EOS id written at documents' ends, record separator): what a token file
    holds besides the documents' own tokens, so part of its cache key.

    A tokenizer's BOS / EOS frame every document; an EOS that is the BOS token is not
    written at the end (the next document's BOS separates them, see
    partita.data.hf_tokenizer), so it reads None here. Records (JSONL lines, Parquet
    rows) under a tokenizer with neither, the byte tokenizer included, would otherwise
    run into one another ("record 0.record 1."): each that does not end with a newline
    gets one, as a text file does. Text files and folders are left as they are.
    """
    bos, eos = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)
    if eos == bos:
        eos = None
    records = getattr(corpus, "records", False)
    return bos, eos, RECORD_SEPARATOR if records and bos is None and eos is None else ""


def cache_path(corpus: Corpus, tokenizer: Tokenizer, cache_dir: str | os.PathLike) -> Path:
    """Where the token file for `corpus` under `tokenizer` lives in `cache_dir`."""
    desc = f"{corpus.fingerprint()}|{tokenizer.name}|{tokenizer.vocab_size}"
    bos, eos, separator = framing(corpus, tokenizer)
    if (bos, eos, separator) != (None, None, ""):  # unframed streams keep their old keys
        desc += f"|bos={bos}|eos={eos}|separator={separator!r}"
    key = hashlib.sha256(desc.encode()).hexdigest()[:16]
    label = "".join(c if c.isalnum() or c in "-_" else "_" for c in corpus.name)[:40]
    return Path(cache_dir) / f"{label}-{key}.tok"


def prepare_tokens(corpus: Corpus, tokenizer: Tokenizer, cache_dir: str | os.PathLike,
                   workers: int = 1) -> Path:
    """Tokenize `corpus` into its cache file unless present; return the file's path.

    Idempotent and atomic (see the module docstring): safe to call from many
    processes at once. Documents are written back to back, framed as `framing` says:
    a tokenizer with BOS/EOS tokens (`encode_documents`) frames every document with
    them, encoded by `workers` processes; records under a tokenizer without BOS or EOS
    end with a newline.

    What reading the source reported (records skipped under data.bad_lines=skip) is
    kept beside the cache file (`notes_path`) and printed again whenever the cache is
    used, so a later run still says that the data lacks those records.
    """
    check_cache_dir(cache_dir)
    path = cache_path(corpus, tokenizer, cache_dir)
    if path.exists():
        for note in cached_notes(path):
            print(f"{note} [counted when the token cache {path.name} was written]",
                  file=sys.stderr)
        return path
    documents = corpus.documents()
    if framing(corpus, tokenizer)[2]:
        documents = _separated(documents)
    try:
        with TokenFileWriter(path, tokenizer.vocab_size) as out:
            if hasattr(tokenizer, "encode_documents"):
                from partita.data.hf_tokenizer import encode_parallel

                for ids in encode_parallel(tokenizer, documents, workers):
                    out.write(ids)
            else:
                for text in documents:
                    out.write(tokenizer.encode(text))
            # Before the token file is published, so whoever finds it finds its notes.
            _write_notes(path, getattr(corpus, "notes", []))
    except OSError as e:
        raise PartitaError(f"Cannot write the token cache '{path}': {e.strerror or e}. Pass a "
                           "cache folder that exists or can be created and is writable, "
                           "with room for about one byte per source byte.") from e
    return path


def notes_path(path: Path) -> Path:
    """The file beside token cache `path` that keeps what preparing it reported (hidden,
    so a cache kept inside a source folder is not read as a source file)."""
    return path.with_name(f".{path.name}.notes")


def cached_notes(path: Path) -> list[str]:
    """The notes kept for token cache `path` (none when it has none)."""
    try:
        return notes_path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []


def _write_notes(path: Path, notes: list[str]) -> None:
    target = notes_path(path)
    if not notes:
        target.unlink(missing_ok=True)  # stale notes of an earlier, failed preparation
        return
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write("\n".join(notes) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)


def _separated(documents):
    for text in documents:
        yield text if text.endswith(RECORD_SEPARATOR) else text + RECORD_SEPARATOR


def check_cache_dir(cache_dir: str | os.PathLike) -> None:
    """Refuse a data.cache_dir that is a file, or lies under one, naming which: writing
    into it fails with a bare "File exists" or "Not a directory" otherwise."""
    folder = Path(cache_dir).expanduser()
    for above in (folder, *folder.parents):
        if above.exists():
            if not above.is_dir():
                where = "is a file" if above == folder else f"lies under the file '{above}'"
                raise PartitaError(f"data.cache_dir '{folder}' {where}, not a folder; give "
                                   "a folder (created when missing) for the token cache.")
            return


@dataclass(frozen=True)
class TokenDataset:
    """A memory-mapped token stream split into a training part and a validation tail."""

    path: Path
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    seq_len: int
    tokenizer: Tokenizer | None  # None for a token file given without data.tokenizer
    # The token between documents (`boundary_token`): an end token, after which a target
    # (the next document's start) is not trained (ignore_index), or a
    # partita.models.documents.DocumentStart that opens each document; None: documents
    # are not marked.
    boundary: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.train) + len(self.val)

    def check_batches(self, global_batch: int) -> None:
        """Raise what the samplers would raise on every rank, from here once: too few
        training windows for one global batch."""
        if problem := too_few_windows(len(self.train), self.seq_len, global_batch):
            raise PartitaError(problem)

    def train_sampler(self, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
                      seed: int = 0) -> BatchSampler:
        """The resumable sampler of training batches for one data-parallel replica."""
        return BatchSampler(self.train, self.seq_len, global_batch, dp_rank, dp_size, seed,
                            boundary=self.boundary)


def split_tokens(tokens: np.ndarray, seq_len: int, val_fraction: float, what: str = "the data",
                 why: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(train, val): val is the last ceil(fraction * N) tokens, at least one window of
    seq_len + 1 (none when fraction is 0); train must keep at least one window. `what`
    names the tokens in the message (one source of a mix); `why`, when given, explains
    a count that is too small (every record skipped)."""
    if not 0.0 <= val_fraction < 1.0:
        raise PartitaError(f"val_fraction must be in [0, 1), got {val_fraction}. Use e.g. "
                           "0.01 to hold out the last 1% of tokens, or 0 for no validation.")
    n = len(tokens)
    n_val = 0 if val_fraction == 0 else max(math.ceil(val_fraction * n), seq_len + 1)
    if n - n_val < seq_len + 1:
        raise PartitaError(f"{what} has {n} tokens{why}, too few for seq_len {seq_len}: "
                           f"training needs at least {seq_len + 1} tokens after holding out "
                           f"{n_val} for validation. Use more data (a larger byte budget "
                           "where one caps the source: data.max_bytes for the built-in "
                           "corpus), "
                           "a shorter seq_len, or a smaller val_fraction.")
    return tokens[: n - n_val], tokens[n - n_val:]


def _skipped_why(path: Path, n_tokens: int) -> str:
    """For an empty token cache whose source had bad records skipped: say so."""
    if n_tokens or not cached_notes(path):
        return ""
    return (" because every record was skipped as bad under data.bad_lines=skip (the "
            "counts are printed above)")


def load_dataset(source: str | os.PathLike | None, cache_dir: str | os.PathLike,
                 seq_len: int, *, val_fraction: float = 0.01,
                 tokenizer: Tokenizer | None = None,
                 max_bytes: int | None = None, text_field: str = "text",
                 bad_lines: str = "error", workers: int = 1) -> TokenDataset:
    """Prepare (once) and open a dataset.

    source: None for the built-in standard-library corpus (capped at `max_bytes`,
    default 8 MiB); a text file or folder of text files (capped at `max_bytes` when
    given); JSONL or Parquet files or folders, or a dataset saved with `datasets`'
    save_to_disk (the `text_field` of each record, see partita.data.sources; read
    whole, whatever `max_bytes`); or a partita token file, used in place without
    copying. A run's `data.max_bytes` budgets the built-in corpus only
    (`load_configured`).
    tokenizer: defaults to the byte tokenizer. A token file is taken as written by it
    when given (its vocabulary must match; its documents are marked by the tokenizer's
    boundary, `boundary_token`), and as of unknown, unmarked documents when not -- the
    same rule as for a token file in `load_mixture`.
    The dataset's `vocab_size` comes from the token file header.
    """
    if seq_len < 1:
        raise PartitaError(f"seq_len must be at least 1, got {seq_len}.")
    if max_bytes is not None and max_bytes <= 0:
        raise PartitaError(f"max_bytes must be positive (or None), got {max_bytes}.")
    if source is not None and is_token_file(source):
        path, tok = Path(source), tokenizer
        tokens, vocab_size = read_token_file(path)
        check_token_file_vocab(path, vocab_size, tok)
    else:
        tok = tokenizer if tokenizer is not None else ByteTokenizer()
        path = prepare_tokens(open_corpus(source, max_bytes, text_field, bad_lines), tok,
                              cache_dir, workers)
        tokens, vocab_size = read_token_file(path)
        if vocab_size != tok.vocab_size:
            raise PartitaError(f"Token cache '{path}' has vocab size {vocab_size} but "
                               f"tokenizer '{tok.name}' has {tok.vocab_size}; the cache is "
                               "stale or corrupt. Delete it and run again.")
    train, val = split_tokens(tokens, seq_len, val_fraction,
                              why=_skipped_why(path, len(tokens)))
    return TokenDataset(path, train, val, vocab_size, seq_len, tok, boundary_token(tok))


def check_token_file_vocab(path: Path, vocab_size: int, tokenizer: Tokenizer | None) -> None:
    """A token file used with a tokenizer must have its vocabulary: its boundary token
    and its decoding would otherwise mean nothing for the file's ids."""
    if tokenizer is not None and vocab_size != tokenizer.vocab_size:
        raise PartitaError(
            f"token file '{path}' has vocab size {vocab_size} but the tokenizer "
            f"'{tokenizer.name}' (data.tokenizer) has {tokenizer.vocab_size}, so it was "
            "not written with that tokenizer. Give the tokenizer that wrote it, or none "
            "(its documents are then not marked).")


def open_corpus(source: str | os.PathLike | None, max_bytes: int | None = None,
                text_field: str = "text", bad_lines: str = "error"):
    """The corpus of `source` (None: the built-in one) for `prepare_tokens`."""
    if source is None:
        return stdlib_corpus(max_bytes if max_bytes is not None else DEFAULT_STDLIB_BYTES)
    from partita.data.sources import structured_corpus

    corpus = structured_corpus(source, text_field, bad_lines)
    return corpus if corpus is not None else text_corpus(source, max_bytes)


def boundary_token(tokenizer: Tokenizer | None) -> int | None:
    """The token between documents in streams `tokenizer` writes (None: unmarked).

    EOS, when the tokenizer has one that is not its BOS: it closes each document. A BOS
    that is also the EOS (GPT-2's `<|endoftext|>`), or a BOS without EOS, opens each
    document instead: a `DocumentStart`, which the loss and the document mask treat
    as such (partita.models.documents)."""
    bos, eos = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)
    if eos is not None and eos != bos:
        return eos
    return None if bos is None else DocumentStart(bos)


def load_mixture(mix: str, cache_dir: str | os.PathLike, seq_len: int, *,
                 val_fraction: float = 0.01, tokenizer: Tokenizer | None = None,
                 text_field: str = "text", bad_lines: str = "error",
                 workers: int = 1) -> TokenDataset:
    """Several sources mixed by weight (`data.mix`, see partita.data.mix)."""
    from partita.data.mix import (
        MixtureLayout,
        check_same_vocab,
        mixture_path,
        parse_mix,
        write_mixture,
    )

    parts = parse_mix(mix)
    check_cache_dir(cache_dir)  # the mixture is written there even from token files
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    prepared, trains, vals, vocabs = [], [], [], []
    for part in parts:
        if not Path(part.source).expanduser().exists():
            raise PartitaError(f"data.mix source '{part.source}' does not exist. Give an "
                               "existing text file or folder, JSONL or Parquet file or "
                               "folder, saved dataset or partita token file, or leave the "
                               "source out of data.mix.")
        if is_token_file(part.source):
            path = Path(part.source)
            tokens, vocab = read_token_file(path)
            check_token_file_vocab(path, vocab, tokenizer)
        else:
            path = prepare_tokens(open_corpus(part.source, None, text_field, bad_lines), tok,
                                  cache_dir, workers)
            tokens, vocab = read_token_file(path)
        train, val = split_tokens(tokens, seq_len, val_fraction,
                                  f"data.mix source '{part.source}'",
                                  _skipped_why(path, len(tokens)))
        prepared.append(path)
        trains.append(train)
        vals.append(val)
        vocabs.append(vocab)
    vocab = check_same_vocab(prepared, vocabs)
    boundary = boundary_token(tok)
    layout = MixtureLayout.plan(trains, vals, [p.weight for p in parts], seq_len, boundary)
    if empty := [p.source for p, take in zip(parts, layout.train_takes) if take == 0]:
        raise PartitaError(
            f"data.mix source(s) {', '.join(empty)} would contribute no training tokens: "
            f"their weight is too small a share of the mixture's "
            f"{sum(layout.train_takes):,} tokens. Raise their weight, or leave them out of "
            "data.mix.")
    path = mixture_path(cache_dir, prepared, [p.weight for p in parts], seq_len, val_fraction,
                        boundary)
    if not path.exists():
        try:
            write_mixture(path, layout, vocab)
        except OSError as e:
            raise PartitaError(f"Cannot write the mixture file '{path}': {e.strerror or e}. "
                               "Give a data.cache_dir that is writable, with room for the "
                               "mixture (as many tokens as its sources together).") from e
    tokens, _ = read_token_file(path)
    return TokenDataset(path, tokens[:layout.train_tokens], tokens[layout.train_tokens:], vocab,
                        seq_len, tok, boundary)


def load_configured(data, cache_dir: str | os.PathLike) -> TokenDataset:
    """The dataset a run's `[data]` section describes (source or mix, tokenizer, fields)."""
    tokenizer = None
    if data.tokenizer:
        from partita.data.hf_tokenizer import HFTokenizer

        tokenizer = HFTokenizer(data.tokenizer)
    workers = max(data.workers, 1)
    options = dict(val_fraction=data.val_fraction, tokenizer=tokenizer,
                   text_field=data.text_field, bad_lines=data.bad_lines, workers=workers)
    if data.mix:
        return load_mixture(data.mix, cache_dir, data.seq_len, **options)
    source = data.source or None
    return load_dataset(source, cache_dir, data.seq_len,
                        max_bytes=data.max_bytes if source is None else None, **options)


def data_notes(data) -> list[str]:
    """What preparing the tokens of a run's `[data]` does other than it may seem to: a
    `data.max_bytes` it does not apply, a tokenizer without BOS or EOS. Said once per job
    before launch (`partita.commands.train_notes.print_notes`), not by every process that
    opens the data."""
    notes = [max_bytes_note(data)]
    if data.tokenizer:
        from partita.data.hf_tokenizer import HFTokenizer

        notes.append(HFTokenizer(data.tokenizer).framing_note())
    return [n for n in notes if n]


def max_bytes_note(data) -> str | None:
    """A note when `data.max_bytes` is set beside a source it does not cap (None
    otherwise). The setting budgets the built-in corpus only: as a cap on every source
    its default would silently cut a user's data to 4 MB."""
    from partita.config_sections import DataSection

    if not (data.source or data.mix) or data.max_bytes == DataSection.max_bytes:
        return None
    given = f"data.mix '{data.mix}'" if data.mix else f"data.source '{data.source}'"
    return (f"partita: data.max_bytes={data.max_bytes} is not applied: it budgets the "
            f"built-in corpus only, and {given} is read whole. To train on less of it, "
            "give a smaller file (e.g. cut with head -c), or leave data.max_bytes out.")
