"""Corpora: which text files feed the tokenizer, in which order, and their fingerprint.

Two kinds of source:

- the built-in corpus: the `.py` files of the running interpreter's standard library
  (`sysconfig.get_paths()["stdlib"]`). Every Python installation has it, so a tiny model
  can be trained with no download. `site-packages`/`dist-packages` are skipped: they
  differ between machines and are not the standard library.
- a user's text file, or a folder of text files.

Which files of a folder count as text: we sniff content instead of trusting
extensions, so `.txt`, `.md`, `.py`, `.json`, `.c`, `README` and files with no
extension are all taken, while images, archives and our own token files are skipped.
A file is text when its first 8 KiB contain no NUL byte and decode as UTF-8 (a
character cut at the 8 KiB boundary is allowed). Hidden entries (name starting with
".", e.g. `.git`) and `__pycache__` are skipped. Files are read as UTF-8; the rare
invalid byte further in becomes U+FFFD, and a byte order mark at a file's start is
dropped (it is no text, and would be the first token of the document).

Walks are in sorted order so that the same tree always gives the same token stream.
A byte budget takes whole files in that order and cuts the last one to fill it
exactly. Unreadable files are skipped.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from partita.errors import PartitaError

DEFAULT_STDLIB_BYTES = 8 * 1024 * 1024
_SNIFF_BYTES = 8192
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class SourceFile:
    """One input file and how many of its leading bytes the corpus uses."""

    path: Path
    size: int
    mtime_ns: int
    take: int


@dataclass(frozen=True)
class Corpus:
    """An ordered list of text files; `name` labels the cache files made from it."""

    name: str
    files: tuple[SourceFile, ...]
    max_bytes: int | None

    @property
    def num_bytes(self) -> int:
        return sum(f.take for f in self.files)

    def fingerprint(self) -> str:
        """Hex digest that changes when any file is added, removed, resized or touched."""
        desc = {"name": self.name, "max_bytes": self.max_bytes,
                "files": [[str(f.path), f.size, f.mtime_ns, f.take] for f in self.files]}
        if any(f.take > PIECE_BYTES for f in self.files):
            # Read in pieces, a file tokenizes a little differently from whole.
            desc["piece_bytes"] = PIECE_BYTES
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()

    def documents(self) -> Iterator[str]:
        """The text of each file in order (files that vanished or became unreadable
        since listing are skipped rather than aborting a long preparation).

        A file of more than PIECE_BYTES comes in pieces (`Piece`, cut after a newline
        where there is one), so a file larger than memory streams through: it stays one
        document, framed once by a tokenizer's BOS and EOS.
        """
        for f in self.files:
            try:
                with open(f.path, "rb") as fh:
                    if f.take <= PIECE_BYTES:
                        yield fh.read(f.take).decode("utf-8-sig", errors="replace")
                    else:
                        yield from _framed(_pieces(fh, f.take))
            except OSError:
                continue


# Files larger than this are read and tokenized in pieces of about this size.
PIECE_BYTES = 16 << 20


class Piece(str):
    """Part of a document read in pieces: `opens` when it is the document's start,
    `closes` when it is its end (a tokenizer frames with BOS / EOS accordingly)."""

    opens: bool
    closes: bool


def _pieces(fh, take: int) -> Iterator[str]:
    """The first `take` bytes of `fh` as text, PIECE_BYTES at a time, each piece cut
    after its last newline (the rest starts the next), so a tokenizer sees whole lines."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
    carry, left = "", take
    while left > 0:
        raw = fh.read(min(PIECE_BYTES, left))
        if not raw:
            break
        left -= len(raw)
        text = carry + decoder.decode(raw, final=left <= 0)
        cut = text.rfind("\n") + 1 if left > 0 else len(text)
        cut = cut or len(text)  # no newline at all: cut where the bytes ended
        carry = text[cut:]
        if cut:
            yield text[:cut]
    rest = carry + decoder.decode(b"", final=True)
    if rest:
        yield rest


def _framed(pieces: Iterator[str]) -> Iterator[Piece]:
    """Pieces marked as the document's first and last (one piece of lookahead)."""
    previous, first = None, True
    for text in pieces:
        if previous is not None:
            yield _piece(previous, first, False)
            first = False
        previous = text
    if previous is not None:
        yield _piece(previous, first, True)


def _piece(text: str, opens: bool, closes: bool) -> Piece:
    piece = Piece(text)
    piece.opens, piece.closes = opens, closes
    return piece


def _looks_like_text(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        # Unless the whole file was read, tolerate a character cut at the 8 KiB mark.
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < _SNIFF_BYTES)
    except UnicodeDecodeError:
        return False
    return True


def _walk_sorted(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place steers os.walk; sorting makes the order deterministic.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath, name)
            if not name.startswith(".") and path.is_file():  # no FIFOs, sockets, devices
                yield path


def _budgeted(name: str, paths: Iterator[Path], max_bytes: int | None) -> Corpus:
    """Stat files in order until `max_bytes` is filled (None: no budget)."""
    files: list[SourceFile] = []
    total = 0
    for p in paths:
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            st = p.stat()
        except OSError:
            continue
        take = st.st_size if max_bytes is None else min(st.st_size, max_bytes - total)
        if take <= 0:
            continue
        files.append(SourceFile(p.resolve(), st.st_size, st.st_mtime_ns, take))
        total += take
    return Corpus(name, tuple(files), max_bytes)


def stdlib_corpus(max_bytes: int = DEFAULT_STDLIB_BYTES) -> Corpus:
    """The standard library's `.py` sources, sorted, up to `max_bytes` bytes."""
    if max_bytes <= 0:
        raise PartitaError(f"The byte budget for the built-in corpus must be positive, "
                           f"got {max_bytes}. Pass a budget such as 8_000_000.")
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = (p for p in _walk_sorted(root) if p.suffix == ".py" and _looks_like_text(p))
    corpus = _budgeted("stdlib", paths, max_bytes)
    if not corpus.files:
        raise PartitaError(f"No readable .py files were found in the standard library at "
                           f"'{root}', so the built-in corpus is empty. Pass a text file or "
                           "folder as the data source instead.")
    return corpus


def text_corpus(source: str | os.PathLike, max_bytes: int | None = None) -> Corpus:
    """A text file, or every text file under a folder (see the module docstring)."""
    root = Path(source).expanduser()
    if not root.exists():
        raise PartitaError(f"data path '{root}' does not exist. Pass an existing text file, "
                           "a folder of text files, or a partita token file; or pass no "
                           "source to use the built-in standard-library corpus.")
    if not (root.is_file() or root.is_dir()):
        raise PartitaError(f"data path '{root}' is neither a regular file nor a folder (a "
                           "FIFO, socket or device would block or never end); write the "
                           "data to a file and pass that.")
    if root.is_file():
        if not _looks_like_text(root):
            raise PartitaError(f"Data file '{root}' is neither UTF-8 text nor a partita "
                               "token file (it contains NUL bytes or invalid UTF-8). Convert "
                               "it to UTF-8 text, or point at a folder of text files.")
        paths: Iterator[Path] = iter([root])
    else:
        paths = (p for p in _walk_sorted(root) if _looks_like_text(p))
    corpus = _budgeted(root.name or "data", paths, max_bytes)
    if (not corpus.files or corpus.num_bytes == 0) and root.is_file():
        raise PartitaError(f"Data file '{root}' is empty; give a file with text in it, or a "
                           "folder of text files.")
    if not corpus.files or corpus.num_bytes == 0:
        raise PartitaError(f"data path '{root}' holds no non-empty text files (files with "
                           "NUL bytes or invalid UTF-8 in their first 8 KiB, hidden files and "
                           "__pycache__ are skipped). Add UTF-8 text files or pick another "
                           "folder.")
    return corpus
