"""One rank's checkpoint file: safetensors, written and read with checksums.

The files are standard safetensors (an 8-byte header length, a JSON header naming
each tensor's dtype, shape and byte range, then the raw bytes), so `safetensors` and
every tool built on it can open them. partita writes and reads them itself for three
things the library does not do: a CRC-32 for every 4 MiB block of every tensor,
computed while writing (so a reader can verify exactly the bytes it reads, and a
rank that needs a tenth of a tensor reads a tenth of it); an fsync before the file
counts as written; and reads of byte ranges from a memory map, never the whole file.
Nothing is unpickled: the header is JSON, the data raw numbers.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from partita.checkpoint.manifest import CheckpointFileError

CRC_BLOCK = 4 << 20  # bytes per checksum block
_WRITE_CHUNK = 16 << 20  # bytes per write call

# safetensors' dtype names.
DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
               torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
               torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in DTYPE_CODES}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes sit in its file, and their block checksums."""

    key: str
    dtype: str  # torch name: float32, bfloat16, ...
    numel: int
    offset: int  # first byte, counted from the start of the file
    crc32: tuple[int, ...]  # one per CRC_BLOCK bytes of this tensor


@dataclass(frozen=True)
class FileRecord:
    name: str
    size: int
    header_crc32: int
    tensors: tuple[TensorRecord, ...]

    def checksum(self) -> int:
        """One number for the whole file: the header's and every block's CRC chained
        (every byte of the file is under one of them)."""
        crc = zlib.crc32(self.header_crc32.to_bytes(4, "little"))
        for t in self.tensors:
            crc = zlib.crc32(b"".join(c.to_bytes(4, "little") for c in t.crc32), crc)
        return crc


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy())


def write_file(path: Path, tensors: dict[str, torch.Tensor],
               metadata: dict[str, str] | None = None) -> FileRecord:
    """Write `tensors` (contiguous, on the CPU) to `path` and fsync it. OSError (a full
    disk, say) propagates; the caller removes what was written."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors does
    head = struct.pack("<Q", len(text)) + text
    records = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, memoryview(head))
        start = len(head)
        for key, t in tensors.items():
            data = _bytes_of(t)
            crcs = []
            for lo in range(0, len(data), CRC_BLOCK):
                block = data[lo:lo + CRC_BLOCK]
                crcs.append(zlib.crc32(block))
                _write_all(fd, block)
            entry = header[key]
            records.append(TensorRecord(key, DTYPE_NAMES[t.dtype], t.numel(),
                                        start + entry["data_offsets"][0], tuple(crcs)))
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileRecord(path.name, len(head) + offset, zlib.crc32(head), tuple(records))


def _write_all(fd: int, data: memoryview) -> None:
    for lo in range(0, len(data), _WRITE_CHUNK):
        chunk = data[lo:lo + _WRITE_CHUNK]
        while len(chunk):
            chunk = chunk[os.write(fd, chunk):]


class FileReader:
    """Byte ranges of one checkpoint file, memory-mapped, each verified as it is read."""

    def __init__(self, path: Path, record: FileRecord) -> None:
        self.path, self.record = path, record
        self.tensors = {t.key: t for t in record.tensors}
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointFileError(
                f"checkpoint file '{path}' is missing; the checkpoint is incomplete. Resume "
                "from another checkpoint (train.resume=PATH) or copy the file again."
            ) from None
        if size != record.size:
            raise CheckpointFileError(
                f"checkpoint file '{path}' has {size:,} bytes but its manifest says "
                f"{record.size:,}: it is truncated or was replaced. Resume from another "
                "checkpoint (train.resume=PATH) or copy the file again."
            )
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        head_len = struct.unpack("<Q", self._map[:8])[0] if size >= 8 else 0
        if zlib.crc32(self._map[:8 + head_len]) != record.header_crc32:
            self._corrupt("its header")

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a tensor read from it is still alive: its owner's now
                pass
            self._map = None

    def read(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of tensor `key` (1-D), after checking the CRC of every
        block they touch. The result shares memory with the map: copy it out."""
        t = self.tensors[key]
        dtype = DTYPES_BY_NAME[t.dtype]
        size = torch.empty((), dtype=dtype).element_size()
        first, last = lo * size // CRC_BLOCK, -(-hi * size // CRC_BLOCK)
        view = memoryview(self._map)
        nbytes = t.numel * size
        for b in range(first, last):
            a = t.offset + b * CRC_BLOCK
            if zlib.crc32(view[a:t.offset + min((b + 1) * CRC_BLOCK, nbytes)]) != t.crc32[b]:
                self._corrupt(f"tensor '{key}' (bytes {b * CRC_BLOCK:,} and on)")
        view.release()
        if hi <= lo:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=hi - lo,
                                offset=t.offset + lo * size)

    def verify_all(self) -> None:
        """Check every block of every tensor (reads the whole file)."""
        for t in self.record.tensors:
            self.read(t.key, 0, t.numel)

    def _corrupt(self, where: str) -> None:
        raise CheckpointFileError(
            f"checkpoint file '{self.path}' is corrupt: the checksum of {where} does not "
            "match the manifest. The file was damaged after it was written; resume from "
            "another checkpoint (train.resume=PATH) or copy the file again."
        )


def record_to_json(record: FileRecord) -> dict:
    return {"name": record.name, "size": record.size, "header_crc32": record.header_crc32,
            "checksum": record.checksum(),
            "tensors": [{"key": t.key, "dtype": t.dtype, "numel": t.numel,
                         "offset": t.offset, "crc32": list(t.crc32)}
                        for t in record.tensors]}


def record_from_json(data: dict) -> FileRecord:
    tensors = tuple(TensorRecord(t["key"], t["dtype"], int(t["numel"]), int(t["offset"]),
                                 tuple(int(c) for c in t["crc32"]))
                    for t in data["tensors"])
    record = FileRecord(data["name"], int(data["size"]), int(data["header_crc32"]), tensors)
    if record.checksum() != int(data["checksum"]):
        raise ValueError(f"the record of '{data['name']}' does not match its checksum")
    return record
