"""Document sources beyond plain text: JSONL and Parquet files or folders, and a Hugging
Face `datasets` dataset saved to disk (`save_to_disk`).

Each is a corpus as `prepare_tokens` reads one (`name`, `fingerprint()`, `documents()`):
documents stream out one at a time (JSONL line by line, Parquet and Arrow in record
batches), so a source larger than memory is never loaded whole. The text of a document
is the field `text_field` of each record.

Bad records: a JSONL line that is not UTF-8 or not JSON, a record without a string
`text_field`, or a Parquet / dataset row whose text is null, is an error naming the file
and line or row (`bad_lines="error"`), or skipped and counted (`bad_lines="skip"`; the
count is printed when the source has been read, and kept in `notes` so that a cached
preparation can repeat it). A JSONL line's text holding a lone surrogate ("\ud800",
valid JSON but no character) is a bad line too: no tokenizer can encode it. A UTF-8
byte order mark before a JSONL file's first line is dropped. A Parquet file or dataset
without the field, or whose field is not a string column, is always an error naming
what it has. A folder is one kind of source: JSONL files, Parquet files, or (read
elsewhere) text files; one that mixes them is refused, naming the odd files (partita's
own token files, a token cache kept in the folder, are not counted).
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

from partita.data.tokenfile import is_token_file
from partita.errors import PartitaError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
BAD_LINES = ("error", "skip")
RECORD_BATCH = 1024
UTF8_BOM = b"\xef\xbb\xbf"


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


class _BadRecords:
    """The bad_lines policy for one file: raise on the first bad record, or count them
    and print the count when the file is done (also appended to `notes`)."""

    def __init__(self, path: object, bad_lines: str, unit: str, notes: list[str]) -> None:
        self.path, self.bad_lines, self.unit, self.notes = path, bad_lines, unit, notes
        self.skipped, self.first = 0, None

    def bad(self, where: int, problem: str) -> None:
        if self.bad_lines == "error":
            raise PartitaError(
                f"{self.path} {self.unit} {where}: {problem}. Fix the {self.unit}, or set "
                f"data.bad_lines=skip to skip such {self.unit}s (they are counted).")
        self.skipped += 1
        self.first = self.first or where

    def report(self) -> None:
        if self.skipped:
            note = (f"partita: skipped {self.skipped} bad {self.unit}(s) of {self.path} "
                    f"(first: {self.unit} {self.first}; data.bad_lines=skip)")
            self.notes.append(note)
            print(note, file=sys.stderr)


def _check_bad_lines(bad_lines: str) -> None:
    if bad_lines not in BAD_LINES:
        raise PartitaError(f"data.bad_lines='{bad_lines}' is unknown; use "
                           f"{' or '.join(BAD_LINES)}.")


class JsonlCorpus:
    """The `text_field` of every record of one or more JSONL files, in sorted file order."""

    records = True  # documents are records: see partita.data.dataset.framing

    def __init__(self, root: Path, text_field: str, bad_lines: str = "error") -> None:
        _check_bad_lines(bad_lines)
        self.name, self.files = root.stem or "jsonl", _files(root, JSONL_SUFFIXES)
        self.text_field, self.bad_lines = text_field, bad_lines
        self.notes: list[str] = []  # skipped-record counts of the last documents() pass
        if not self.files:
            raise PartitaError(f"'{root}' holds no {'/'.join(JSONL_SUFFIXES)} files.")

    def fingerprint(self) -> str:
        return _stat_fingerprint("jsonl", self.files, self.text_field, self.bad_lines)

    def documents(self) -> Iterator[str]:
        self.notes = []
        for path in self.files:
            bad = _BadRecords(f"'{path}'", self.bad_lines, "line", self.notes)
            # Bytes, decoded line by line: invalid UTF-8 is a bad line like invalid JSON,
            # not text silently replaced with U+FFFD (a text file's is refused too).
            with open(path, "rb") as fh:
                for lineno, raw in enumerate(fh, 1):
                    if lineno == 1 and raw.startswith(UTF8_BOM):  # editors on Windows add one
                        raw = raw[len(UTF8_BOM):]
                    if not raw.strip():
                        continue
                    text, problem = self._text(raw)
                    if problem is None:
                        yield text
                    else:
                        bad.bad(lineno, problem)
            bad.report()

    def _text(self, raw: bytes) -> tuple[str, str | None]:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return "", (f"not UTF-8 (byte {raw[exc.start]:#04x} at byte {exc.start + 1} of "
                        "the line)")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            return "", f"not JSON ({exc.msg} at column {exc.colno})"
        if not isinstance(record, dict) or not isinstance(record.get(self.text_field), str):
            return "", (f"no string field '{self.text_field}' (set data.text_field to the "
                        "field that holds the text)")
        text = record[self.text_field]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            # JSON lets "\ud800" through; it is half of a UTF-16 pair, not a character.
            return "", (f"'{self.text_field}' holds a lone surrogate "
                        f"({text[exc.start]!r} at character {exc.start + 1}), not text")
        return text, None


def _text_rows(values: Iterator[str | None], bad: _BadRecords, field: str) -> Iterator[str]:
    """The strings of a string column, rows counted from 1; a null is a bad row."""
    for row, text in enumerate(values, 1):
        if text is None:
            bad.bad(row, f"'{field}' is null")
        else:
            yield text
    bad.report()


def _string_column(where: str, field: str, kind: str) -> None:
    """Refuse a text field stored as anything but strings (binary, numbers): its values
    were dropped one by one, and the run failed with "the data has 0 tokens"."""
    if kind not in ("string", "large_string", "string_view", "utf8", "large_utf8"):
        raise PartitaError(
            f"{where} column '{field}' holds {kind}, not text: the text field must be a "
            "string column. Convert it to strings (binary holding UTF-8 text: decode it), "
            "or set data.text_field to a string column.")


class ParquetCorpus:
    """The `text_field` column of one or more Parquet files, read a record batch at a time."""

    records = True  # documents are records: see partita.data.dataset.framing

    def __init__(self, root: Path, text_field: str, bad_lines: str = "error") -> None:
        pq = _import("pyarrow.parquet", "Parquet sources need pyarrow")
        _check_bad_lines(bad_lines)
        self.name, self.files = root.stem or "parquet", _files(root, PARQUET_SUFFIXES)
        self.text_field, self.bad_lines = text_field, bad_lines
        self.notes: list[str] = []  # skipped-record counts of the last documents() pass
        if not self.files:
            raise PartitaError(f"'{root}' holds no .parquet files.")
        for path in self.files:  # fail before any tokenizing, naming the file
            try:
                schema = pq.ParquetFile(path).schema_arrow
            except Exception as exc:
                raise PartitaError(f"'{path}' cannot be read as Parquet ({exc}).") from None
            if text_field not in schema.names:
                raise PartitaError(
                    f"'{path}' has no column '{text_field}' (its columns: "
                    f"{', '.join(schema.names)}); set data.text_field to the column that "
                    "holds the text.")
            _string_column(f"'{path}'", text_field, str(schema.field(text_field).type))

    def fingerprint(self) -> str:
        return _stat_fingerprint("parquet", self.files, self.text_field, self.bad_lines)

    def documents(self) -> Iterator[str]:
        pq = _import("pyarrow.parquet", "Parquet sources need pyarrow")
        self.notes = []
        for path in self.files:
            reader = pq.ParquetFile(path)
            batches = reader.iter_batches(batch_size=RECORD_BATCH, columns=[self.text_field])
            values = (t for batch in batches for t in batch.column(0).to_pylist())
            yield from _text_rows(values, _BadRecords(f"'{path}'", self.bad_lines, "row",
                                                      self.notes), self.text_field)


class DiskDatasetCorpus:
    """A `datasets.Dataset` saved with `save_to_disk` (its "train" split for a
    DatasetDict), iterated in batches over its memory-mapped Arrow files."""

    records = True  # documents are records: see partita.data.dataset.framing

    def __init__(self, root: Path, text_field: str, bad_lines: str = "error") -> None:
        _check_bad_lines(bad_lines)
        self.root, self.name, self.text_field = root, root.name or "dataset", text_field
        self.bad_lines = bad_lines
        self.notes: list[str] = []  # skipped-record counts of the last documents() pass
        ds = self._open()
        if text_field not in ds.column_names:
            raise PartitaError(
                f"the dataset at '{root}' has no column '{text_field}' (its columns: "
                f"{', '.join(ds.column_names)}); set data.text_field to the text column.")
        feature = ds.features[text_field]
        _string_column(f"the dataset at '{root}'", text_field,
                       str(getattr(feature, "dtype", type(feature).__name__)))
        self._fingerprint = getattr(ds, "_fingerprint", "")

    def _open(self):
        datasets = _import("datasets", "Hugging Face dataset sources need `datasets`")
        try:
            ds = datasets.load_from_disk(str(self.root))
        except Exception as exc:
            raise PartitaError(f"'{self.root}' cannot be opened with datasets.load_from_disk "
                               f"({exc}).") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                # Training on whichever split came first (often "test") went unnoticed.
                raise PartitaError(
                    f"the DatasetDict at '{self.root}' has no 'train' split (its splits: "
                    f"{', '.join(ds)}); partita trains on the train split. Point "
                    f"data.source at one split's folder (e.g. '{self.root / next(iter(ds))}'"
                    "), or save the data with a train split.")
            ds = ds["train"]
        return ds

    def fingerprint(self) -> str:
        files = sorted(p for p in self.root.rglob("*.arrow"))
        return _stat_fingerprint("hf-disk", files, self.text_field, self._fingerprint,
                                 self.bad_lines)

    def documents(self) -> Iterator[str]:
        ds = self._open().select_columns([self.text_field])
        self.notes = []
        values = (t for batch in ds.iter(batch_size=RECORD_BATCH) for t in batch[self.text_field])
        yield from _text_rows(values, _BadRecords(f"the dataset at '{self.root}'",
                                                  self.bad_lines, "row", self.notes),
                              self.text_field)


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
        return DiskDatasetCorpus(root, text_field, bad_lines)
    kind = _folder_kind(root)  # one walk of a folder (None for a file)
    if root.suffix in PARQUET_SUFFIXES or kind == "Parquet":
        return ParquetCorpus(root, text_field, bad_lines)
    if root.suffix in JSONL_SUFFIXES or kind == "JSONL":
        return JsonlCorpus(root, text_field, bad_lines)
    return None


def _folder_kind(root: Path) -> str | None:
    """"JSONL" or "Parquet" for a folder whose (non-hidden) files are all of that kind,
    None for any other folder or a file. A folder mixing records with other files is
    refused: read as text it trained on raw JSON, and read as records it would drop
    the other files without a word."""
    if not root.is_dir():
        return None
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(root).parts)
                   and not (p.suffix == ".tok" and is_token_file(p)))  # a cache kept here
    kinds = {"JSONL": JSONL_SUFFIXES, "Parquet": PARQUET_SUFFIXES}
    found = {kind: [p for p in files if p.suffix in suffixes] for kind, suffixes in kinds.items()}
    present = [kind for kind, paths in found.items() if paths]
    if not present:
        return None
    odd = [p for p in files if p not in found[present[0]]]
    if odd:
        names = ", ".join(str(p.relative_to(root)) for p in odd[:5])
        more = f" and {len(odd) - 5} more" if len(odd) > 5 else ""
        raise PartitaError(
            f"data source '{root}' mixes {len(found[present[0]])} {present[0]} file(s) with "
            f"{len(odd)} other file(s): {names}{more}. A folder is read as one kind of "
            "source; move the other files out (or point at a folder holding only one "
            "kind), or give each kind as its own source in data.mix.")
    return present[0]


def _import(module: str, why: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise PartitaError(f"{why}: pip install 'partita[data]' (pyarrow and datasets)."
                           ) from None
