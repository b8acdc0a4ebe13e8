"""A Hugging Face `tokenizers` tokenizer (a tokenizer.json, or a model folder holding one)
as partita's `Tokenizer`, and parallel encoding of many documents.

The tokenizer's `name` holds a hash of its tokenizer.json, so the token cache of a
corpus is rebuilt when the tokenizer changes. Its `bos_id` / `eos_id` (from
tokenizer_config.json, else the folder's config.json) mark document boundaries in the
token stream: every document is written as BOS, its tokens, EOS (those it has). When BOS
and EOS are one token (GPT-2's `<|endoftext|>`, Pythia, GPT-NeoX, OPT) a document is
written as that token and its tokens, so one token separates two documents, as GPT-2
style pretraining packs them, rather than two (`frame`).
A tokenizer.json alone, without tokenizer_config.json or config.json beside it, names
no BOS or EOS: its documents are packed unframed and unmarked (`framing_note` says so).
`tokenizers` is imported lazily (it ships with transformers; see pyproject's `hf` extra).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from partita.errors import PartitaError


def tokenizer_file(path: str | os.PathLike) -> Path:
    """The tokenizer.json of `path` (the file itself or a folder holding one)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise PartitaError(
            f"data.tokenizer='{path}' has no tokenizer.json; give a tokenizer.json file or a "
            "Hugging Face model folder holding one (a tokenizer saved with the `tokenizers` "
            "library or transformers' save_pretrained).")
    return p


def _special_tokens(folder: Path) -> dict[str, str]:
    """bos_token / eos_token strings from tokenizer_config.json, when present."""
    out = {}
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError):
            return out
        for key in ("bos_token", "eos_token"):
            value = data.get(key)
            if isinstance(value, dict):  # an AddedToken serialised with its options
                value = value.get("content")
            if isinstance(value, str):
                out[key] = value
    return out


class HFTokenizer:
    """partita's Tokenizer over a `tokenizers.Tokenizer` (picklable: reloads from path)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = tokenizer_file(path)
        raw = self.path.read_bytes()
        digest = hashlib.sha256(raw).hexdigest()[:16]
        self.name = f"hf-{digest}"
        self._tok = _load(self.path)
        # The largest id + 1, not the count of tokens: ids may have gaps, and the
        # embedding needs a row for the largest.
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(int(self._tok.get_vocab_size(with_added_tokens=True)),
                              max(ids, default=-1) + 1)
        special = _special_tokens(self.path.parent)
        # Each from tokenizer_config.json, else from the folder's config.json.
        fallback_bos, fallback_eos = _ids_from_model_config(self.path.parent)
        bos, eos = self._id(special, "bos_token"), self._id(special, "eos_token")
        self.bos_id = bos if bos is not None else fallback_bos
        self.eos_id = eos if eos is not None else fallback_eos

    def _id(self, special: dict[str, str], key: str) -> int | None:
        """The id of tokenizer_config.json's `key` token (None when it names none).

        A token missing from the vocabulary is refused: ignoring it left documents
        unframed and unmasked without a word."""
        token = special.get(key)
        if token is None:
            return None
        found = self._tok.token_to_id(token)
        if found is None:
            raise PartitaError(
                f"{self.path.parent / 'tokenizer_config.json'} names {key} {token!r}, which "
                f"is not in the vocabulary of {self.path}; give the token that file uses "
                f"for it, add the token to the tokenizer, or remove {key} from "
                "tokenizer_config.json (documents are then not framed by it).")
        return int(found)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_tok"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tok = _load(self.path)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint32) if self.vocab_size > 1 << 16 else np.dtype(np.uint16)

    def encode(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=self.dtype)

    def encode_document(self, text: str) -> np.ndarray:
        """BOS, the text's tokens, EOS (those this tokenizer has)."""
        return self.frame(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """Each text framed; a piece of a longer document (partita.data.corpus.Piece)
        gets BOS only if it opens the document and EOS only if it closes it."""
        encoded = self._tok.encode_batch(texts, add_special_tokens=False)
        return [self.frame(e.ids, getattr(t, "opens", True), getattr(t, "closes", True))
                for t, e in zip(texts, encoded)]

    @property
    def closes_documents(self) -> bool:
        """Whether documents end with EOS: not when EOS is BOS, which opens the next
        document instead (see the module docstring)."""
        return self.eos_id is not None and self.eos_id != self.bos_id

    def frame(self, ids: list[int], opens: bool = True, closes: bool = True) -> np.ndarray:
        """BOS (if `opens`), `ids`, EOS (if `closes` and EOS differs from BOS)."""
        head = [self.bos_id] if self.bos_id is not None and opens else []
        tail = [self.eos_id] if self.closes_documents and closes else []
        return np.asarray(head + ids + tail, dtype=self.dtype)

    def framing_note(self) -> str | None:
        """A warning when this tokenizer names neither BOS nor EOS (None otherwise)."""
        if self.bos_id is not None or self.eos_id is not None:
            return None
        return (f"partita: the tokenizer {self.path} names no BOS or EOS token (no "
                "tokenizer_config.json or config.json beside it says which), so documents "
                "are packed without a boundary token (records of JSONL, Parquet or a "
                "dataset each end with a newline; text files are joined as they are) and "
                "are not masked from one another; add a tokenizer_config.json with "
                "bos_token / eos_token to frame them.")

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer('{self.path}')"


def _load(path: Path):
    try:
        from tokenizers import Tokenizer as RustTokenizer
    except ImportError:
        raise PartitaError("data.tokenizer needs the `tokenizers` package: pip install "
                           "'partita[hf]' (or pip install tokenizers).") from None
    try:
        return RustTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a plain Exception on a bad file
        raise PartitaError(f"'{path}' cannot be read as a tokenizer ({exc}); give a "
                           "tokenizer.json written by the `tokenizers` library.") from None


def _ids_from_model_config(folder: Path) -> tuple[int | None, int | None]:
    """bos_token_id and eos_token_id of the folder's config.json; of a list of end ids
    (Llama 3.1 Instruct's [128001, 128008, 128009]) the first frames documents."""
    config = folder / "config.json"
    try:
        data = json.loads(config.read_text()) if config.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return None, None
    if not isinstance(data, dict):
        return None, None

    def one(value: object) -> int | None:
        if isinstance(value, list) and value:
            value = value[0]
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return one(data.get("bos_token_id")), one(data.get("eos_token_id"))


def special_token_ids(path: str | os.PathLike, bos: int | None = None,
                      eos: int | None = None) -> tuple[int | None, int | None]:
    """(bos, eos) ids of the tokenizer at `path`, falling back to the given ones."""
    tok = HFTokenizer(path)
    return (tok.bos_id if tok.bos_id is not None else bos,
            tok.eos_id if tok.eos_id is not None else eos)


# Parallel encoding -------------------------------------------------------------------

_WORKER_TOKENIZER: HFTokenizer | None = None


def _init_worker(tokenizer: HFTokenizer) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORKER_TOKENIZER = tokenizer


def _encode_batch(texts: list[str]) -> list[np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    return _WORKER_TOKENIZER.encode_documents(texts)


def _batches(docs: Iterable[str], batch_bytes: int) -> Iterator[list[str]]:
    batch, size = [], 0
    for text in docs:
        batch.append(text)
        size += len(text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_parallel(tokenizer: HFTokenizer, docs: Iterable[str], workers: int,
                    batch_bytes: int = 1 << 20) -> Iterator[np.ndarray]:
    """Each document framed by BOS/EOS, in order, encoded by `workers` processes.

    Documents stream through in batches of about `batch_bytes` characters: at most a few
    batches per worker are in flight, never the whole source. workers <= 1 encodes here,
    where `encode_batch` already spreads a batch over every core (Rust threads). Worker
    processes are spawned, so a script that calls this with workers > 1 needs the usual
    `if __name__ == "__main__":` guard (`partita train` has it).
    """
    if workers <= 1:
        for batch in _batches(docs, batch_bytes):
            yield from tokenizer.encode_documents(batch)
        return
    import multiprocessing as mp
    from collections import deque

    # spawn: the parent may hold threads (torch, tokenizers) that fork would copy mid-use.
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        # Pool.imap would read the whole input ahead; a bounded queue keeps memory flat.
        pending: deque = deque()
        for batch in _batches(docs, batch_bytes):
            pending.append(pool.apply_async(_encode_batch, (batch,)))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()
