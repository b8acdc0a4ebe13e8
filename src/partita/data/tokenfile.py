"""The token file: a flat array of token ids behind a 32-byte header, read by memmap.

Layout (little endian):

    offset  size  field
    0       8     magic b"PARTTOK\\0"
    8       4     format version (uint32, currently 1)
    12      4     bytes per token (uint32: 1, 2 or 4 -> uint8, uint16, uint32)
    16      8     vocab size (uint64)
    24      8     token count (uint64)
    32      ...   token ids

The narrowest dtype that holds the vocabulary is used (uint8 for the byte tokenizer),
so a corpus costs one byte per token on disk and in the page cache.

`TokenFileWriter` writes to a temporary name in the target folder and renames it with
`os.replace` only after the data and the final header are on disk. A crash therefore
leaves at worst a stray temporary file, never a file under the final name that looks
complete; and several processes writing the same file at once each rename a complete
copy, the last one winning.
"""

from __future__ import annotations

import os
import socket
import struct
import tempfile
from pathlib import Path

import numpy as np

from partita.errors import PartitaError
from partita.proc_stat import pid_alive

MAGIC = b"PARTTOK\0"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQ")
HEADER_BYTES = _HEADER.size  # 32
_DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}


# Token files up to this size are checked id by id on open; larger ones are sampled.
FULL_SCAN_BYTES = 64 << 20
SAMPLE_BLOCKS = 64


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds ids 0..vocab_size-1."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 1 << 8:
        return _DTYPES[1]
    if vocab_size <= 1 << 16:
        return _DTYPES[2]
    if vocab_size <= 1 << 32:
        return _DTYPES[4]
    raise ValueError(f"vocab_size {vocab_size} does not fit in 32-bit token ids")


def is_token_file(path: str | os.PathLike) -> bool:
    """True when `path` is a regular file that starts with the token-file magic."""
    if not Path(path).is_file():  # never open a FIFO or device: a read could block forever
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


class TokenFileWriter:
    """Streams token ids into `path` atomically; use as a context manager.

    Leaving the `with` block normally publishes the file; leaving it by an exception
    deletes the temporary file and publishes nothing.
    """

    def __init__(self, path: str | os.PathLike, vocab_size: int) -> None:
        self.path = Path(path)
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(self.vocab_size)
        self.count = 0
        self._file = None
        self._tmp: str | None = None

    def __enter__(self) -> TokenFileWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A unique temporary name per writer, in the same folder so os.replace is a
        # rename within one file system (atomic), never a copy.
        # The name carries host and pid, so a writer killed outright (SIGKILL) leaves a
        # file the next writer on that host recognises as dead and removes.
        host = socket.gethostname()
        _remove_dead_writers(self.path, host)
        fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.{host}.{os.getpid()}.",
                                         suffix=".tmp", dir=self.path.parent)
        self._file = os.fdopen(fd, "wb")
        self._file.write(b"\0" * HEADER_BYTES)  # real header written at close
        return self

    def write(self, ids: np.ndarray) -> None:
        """Append token ids (any integer array); each must be < vocab_size."""
        arr = np.asarray(ids)
        if arr.size == 0:
            return
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            raise ValueError(f"token ids {arr.min()}..{arr.max()} outside vocab of "
                             f"{self.vocab_size}")
        self._file.write(arr.astype(self.dtype, copy=False).tobytes())
        self.count += arr.size

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._file.seek(0)
                self._file.write(_HEADER.pack(MAGIC, VERSION, self.dtype.itemsize,
                                              self.vocab_size, self.count))
                self._file.flush()
                os.fsync(self._file.fileno())
            self._file.close()
            if exc_type is None:
                # mkstemp makes the file private (0600); a cache shared by the users of
                # a cluster must be readable like any file written with open().
                os.chmod(self._tmp, 0o644)
                os.replace(self._tmp, self.path)
        finally:
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)


def _remove_dead_writers(path: Path, host: str) -> None:
    """Delete temporaries of `path` left on this host by writers that no longer run."""
    for tmp in path.parent.glob(f".{path.name}.{host}.*.tmp"):
        pid = tmp.name[len(f".{path.name}.{host}."):].split(".")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)


def write_token_file(path: str | os.PathLike, ids: np.ndarray, vocab_size: int) -> Path:
    """Write `ids` as a complete token file at `path` (atomically); return the path."""
    with TokenFileWriter(path, vocab_size) as w:
        w.write(ids)
    return Path(path)


def read_token_file(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """Memory-map a token file: (read-only 1-d array of ids, vocab size).

    Every way a file can be unusable (missing, not a token file, newer format,
    truncated, trailing bytes) raises PartitaError saying how to recover.
    """
    path = Path(path)
    fix = (f"Delete '{path}' and run again: a cached file is rebuilt from its source; "
           "a token file you supplied must be regenerated.")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise PartitaError(f"Cannot read token file '{path}': {e.strerror or e}. Check that "
                           "the path is right and readable.") from e
    if len(head) < HEADER_BYTES or head[: len(MAGIC)] != MAGIC:
        raise PartitaError(f"'{path}' is not a partita token file (missing or bad header "
                           f"magic {MAGIC!r}); it may be corrupt or a different format. {fix}")
    _, version, width, vocab, count = _HEADER.unpack(head)
    if version != VERSION:
        raise PartitaError(f"token file '{path}' has format version {version}, but this "
                           f"partita reads version {VERSION}. {fix}")
    if width not in _DTYPES or vocab < 1:
        raise PartitaError(f"token file '{path}' has a corrupt header (bytes per token "
                           f"{width}, vocab size {vocab}). {fix}")
    expected = HEADER_BYTES + count * width
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise PartitaError(f"token file '{path}' is {what}: the header promises {count} tokens "
                           f"({expected} bytes) but the file has {size} bytes, so it was "
                           f"probably cut off while being written or copied. {fix}")
    if count == 0:  # np.memmap refuses zero-length maps
        return np.zeros(0, dtype=_DTYPES[width]), int(vocab)
    data = np.memmap(path, dtype=_DTYPES[width], mode="r", offset=HEADER_BYTES,
                     shape=(count,))
    check_token_ids(data, int(vocab), path, fix)
    return data, int(vocab)


def check_token_ids(data: np.ndarray, vocab: int, path: Path, fix: str = "",
                    full_scan_bytes: int = FULL_SCAN_BYTES) -> int:
    """Raise PartitaError if an id is >= `vocab`; return the bytes scanned.

    A file up to `full_scan_bytes` is scanned whole; a larger one in SAMPLE_BLOCKS evenly
    spaced blocks that together make `full_scan_bytes`, so a file of wrong width or vocabulary
    is caught at once, while a single bad id deep in a huge file may slip through (the
    embedding lookup then fails with the id named).
    """
    total = data.nbytes
    if total <= full_scan_bytes:
        blocks = [(0, len(data))]
    else:
        per_block = max(1, full_scan_bytes // data.itemsize // SAMPLE_BLOCKS)
        starts = np.linspace(0, len(data) - per_block, SAMPLE_BLOCKS).astype(np.int64)
        blocks = [(int(s), int(s) + per_block) for s in starts]
    scanned = 0
    for start, stop in blocks:
        block = np.asarray(data[start:stop])
        scanned += block.nbytes
        if block.size and int(block.max()) >= vocab:
            where = start + int(np.argmax(block >= vocab))
            raise PartitaError(
                f"token file '{path}' holds token id {int(data[where])} at position {where}, "
                f"but its header's vocabulary has {vocab} ids (scanned {scanned:,} of "
                f"{total:,} bytes), so it is corrupt or was written with another "
                f"vocabulary. {fix}"
            )
    return scanned
