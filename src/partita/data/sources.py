"""Document sources beyond plain text: JSONL and Parquet files or folders, and a Hugging
Face `datasets` dataset saved to disk (`save_to_disk`).

Each is a corpus as `prepare_tokens` reads one (`name`, `fingerprint()`, `documents()`):
documents stream out one at a time (JSONL line by line, Parquet and Arrow in record
batches), so a source larger than memory is never loaded whole. The text of a document
is the field `text_field` of each record.

Bad records: a JSONL line that is not JSON, or a record without a string `text_field`,
is an error naming the file and line (`bad_lines="error"`), or skipped and counted
(`bad_lines="skip"`; the count is printed when the source has been read). A Parquet file
or dataset without the field is always an error naming the columns it has.
pyarrow and datasets are imported only when such a source is used (pyproject's `data`
extra installs them).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from partita.errors import PartitaError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
BAD_LINES = ("error", "skip")
RECORD_BATCH = 1024


def _files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.suffix in suffixes and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def _stat_fingerprint(kind: str, files: list[Path], *extra: object) -> str:
    desc = [kind, *map(str, extra)]
    for p in files:
        st = p.stat()
        desc.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()


class JsonlCorpus:
    """The `text_field` of every record of one or more JSONL files, in sorted file order."""

    def __init__(self, root: Path, text_field: str, bad_lines: str = "error") -> None:
        if bad_lines not in BAD_LINES:
            raise PartitaError(f"data.bad_lines='{bad_lines}' is unknown; use "
                               f"{' or '.join(BAD_LINES)}.")
        self.name, self.files = root.stem or "jsonl", _files(root, JSONL_SUFFIXES)
        self.text_field, self.bad_lines = text_field, bad_lines
        if not self.files:
            raise PartitaError(f"'{root}' holds no {'/'.join(JSONL_SUFFIXES)} files.")

    def fingerprint(self) -> str:
        return _stat_fingerprint("jsonl", self.files, self.text_field, self.bad_lines)

    def documents(self) -> Iterator[str]:
        for path in self.files:
            skipped, first = 0, None
            with open(path, encoding="utf-8", errors="replace") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    text, problem = self._text(line)
                    if problem is None:
                        yield text
                        continue
                    if self.bad_lines == "error":
                        raise PartitaError(
                            f"'{path}' line {lineno}: {problem}. Fix the line, or set "
                            "data.bad_lines=skip to skip such lines (they are counted).")
                    skipped += 1
                    first = first or lineno
            if skipped:
                print(f"partita: skipped {skipped} bad line(s) of '{path}' (first: line "
                      f"{first}; data.bad_lines=skip)", file=sys.stderr)

    def _text(self, line: str) -> tuple[str, str | None]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            return "", f"not JSON ({exc.msg} at column {exc.colno})"
        if not isinstance(record, dict) or not isinstance(record.get(self.text_field), str):
            return "", (f"no string field '{self.text_field}' (set data.text_field to the "
                        "field that holds the text)")
        return record[self.text_field], None


class ParquetCorpus:
    """The `text_field` column of one or more Parquet files, read a record batch at a time."""

    def __init__(self, root: Path, text_field: str) -> None:
        pq = _import("pyarrow.parquet", "Parquet sources need pyarrow")
        self.name, self.files = root.stem or "parquet", _files(root, PARQUET_SUFFIXES)
        self.text_field = text_field
        if not self.files:
            raise PartitaError(f"'{root}' holds no .parquet files.")
        for path in self.files:  # fail before any tokenizing, naming the file
            try:
                names = pq.ParquetFile(path).schema_arrow.names
            except Exception as exc:
                raise PartitaError(f"'{path}' cannot be read as Parquet ({exc}).") from None
            if text_field not in names:
                raise PartitaError(
                    f"'{path}' has no column '{text_field}' (its columns: {', '.join(names)}); "
                    "set data.text_field to the column that holds the text.")

    def fingerprint(self) -> str:
        return _stat_fingerprint("parquet", self.files, self.text_field)

    def documents(self) -> Iterator[str]:
        pq = _import("pyarrow.parquet", "Parquet sources need pyarrow")
        for path in self.files:
            reader = pq.ParquetFile(path)
            for batch in reader.iter_batches(batch_size=RECORD_BATCH, columns=[self.text_field]):
                yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str))


class DiskDatasetCorpus:
    """A `datasets.Dataset` saved with `save_to_disk` (its "train" split for a
    DatasetDict), iterated in batches over its memory-mapped Arrow files."""

    def __init__(self, root: Path, text_field: str) -> None:
        self.root, self.name, self.text_field = root, root.name or "dataset", text_field
        ds = self._open()
        if text_field not in ds.column_names:
            raise PartitaError(
                f"the dataset at '{root}' has no column '{text_field}' (its columns: "
                f"{', '.join(ds.column_names)}); set data.text_field to the text column.")
        self._fingerprint = getattr(ds, "_fingerprint", "")

    def _open(self):
        datasets = _import("datasets", "Hugging Face dataset sources need `datasets`")
        try:
            ds = datasets.load_from_disk(str(self.root))
        except Exception as exc:
            raise PartitaError(f"'{self.root}' cannot be opened with datasets.load_from_disk "
                               f"({exc}).") from None
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else next(iter(ds))
            ds = ds[split]
        return ds

    def fingerprint(self) -> str:
        files = sorted(p for p in self.root.rglob("*.arrow"))
        return _stat_fingerprint("hf-disk", files, self.text_field, self._fingerprint)

    def documents(self) -> Iterator[str]:
        ds = self._open().select_columns([self.text_field])
        for batch in ds.iter(batch_size=RECORD_BATCH):
            yield from (t for t in batch[self.text_field] if isinstance(t, str))


def is_disk_dataset(root: Path) -> bool:
    return root.is_dir() and any((root / n).is_file() for n in
                                 ("dataset_dict.json", "state.json", "dataset_info.json"))


def structured_corpus(source: str | os.PathLike, text_field: str = "text",
                      bad_lines: str = "error"):
    """The corpus of a JSONL / Parquet / saved-dataset source, or None for other sources
    (plain text files and folders, token files)."""
    root = Path(source).expanduser()
    if not root.exists():
        return None
    if is_disk_dataset(root):
        return DiskDatasetCorpus(root, text_field)
    if root.suffix in PARQUET_SUFFIXES or _only(root, PARQUET_SUFFIXES):
        return ParquetCorpus(root, text_field)
    if root.suffix in JSONL_SUFFIXES or _only(root, JSONL_SUFFIXES):
        return JsonlCorpus(root, text_field, bad_lines)
    return None


def _only(root: Path, suffixes: tuple[str, ...]) -> bool:
    """A folder whose (non-hidden) files all end in one of `suffixes`; a folder mixing
    kinds stays a folder of text files, as before these sources existed."""
    if not root.is_dir():
        return False
    files = [p for p in root.rglob("*") if p.is_file()
             and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    return bool(files) and all(p.suffix in suffixes for p in files)


def _import(module: str, why: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise PartitaError(f"{why}: pip install 'partita[data]' (pyarrow and datasets)."
                           ) from None
