"""Sources' records: splits of a saved DatasetDict, the bad_lines policy in cache keys,
lone surrogates, byte order marks, and a token cache kept in a source folder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from partita.data import load_dataset, read_token_file, text_corpus
from partita.errors import PartitaError

DOCS = [f"record {i} says hello" for i in range(60)]


def write_jsonl(path, texts, bad: dict[int, str] | None = None):
    lines = [json.dumps({"text": t}) for t in texts]
    for lineno, raw in (bad or {}).items():
        lines.insert(lineno - 1, raw)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_dataset_dict_without_a_train_split_is_refused_naming_its_splits(tmp_path):
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    from datasets.table import InMemoryTable

    split = datasets.Dataset(InMemoryTable(pa.table({"text": DOCS})), fingerprint="e" * 16)
    datasets.DatasetDict({"test": split, "validation": split}).save_to_disk(
        str(tmp_path / "saved"))
    with pytest.raises(PartitaError, match=r"no 'train' split \(its splits: test, "
                                           r"validation\).*saved/test"):
        load_dataset(tmp_path / "saved", tmp_path / "c", 8)


def test_bad_lines_keys_a_parquet_cache(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": [*DOCS[:30], None, *DOCS[30:]]}),
                   tmp_path / "nulls.parquet")
    skipped = load_dataset(tmp_path / "nulls.parquet", tmp_path / "c", 8, bad_lines="skip")
    assert "skipped 1 bad row(s)" in capsys.readouterr().err
    again = load_dataset(tmp_path / "nulls.parquet", tmp_path / "c", 8, bad_lines="skip")
    assert again.path == skipped.path
    with pytest.raises(PartitaError, match="row 31: 'text' is null"):
        load_dataset(tmp_path / "nulls.parquet", tmp_path / "c", 8)  # not the skip cache


def test_a_lone_surrogate_is_a_bad_line(tmp_path, capsys):
    src = write_jsonl(tmp_path / "s.jsonl", DOCS, bad={3: '{"text": "half \\ud800 pair"}'})
    with pytest.raises(PartitaError, match=r"s.jsonl' line 3: 'text' holds a lone surrogate"):
        load_dataset(src, tmp_path / "c", 8)
    ds = load_dataset(src, tmp_path / "c", 8, bad_lines="skip")
    assert "skipped 1 bad line(s)" in capsys.readouterr().err
    assert ds.num_tokens == sum(len(d) + 1 for d in DOCS)


def test_a_lone_surrogate_is_skipped_under_a_real_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from tests.unit.test_data_boundaries import make_tokenizer

    tok = make_tokenizer(tmp_path / "tok", "<s>", "</s>")
    src = write_jsonl(tmp_path / "s.jsonl", DOCS, bad={2: '{"text": "\\udc00"}'})
    ds = load_dataset(src, tmp_path / "c", 8, tokenizer=tok, bad_lines="skip")
    assert (np.asarray(read_token_file(ds.path)[0]) == tok.bos_id).sum() == len(DOCS)


def test_a_byte_order_mark_is_dropped_from_jsonl_and_text(tmp_path):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + write_jsonl(tmp_path / "plain.jsonl", DOCS).read_bytes())
    tokens = np.asarray(load_dataset(src, tmp_path / "c", 8).train)
    assert bytes(tokens[:8]) == b"record 0"
    text = tmp_path / "bom.txt"
    text.write_bytes(b"\xef\xbb\xbfhello\n")
    assert list(text_corpus(text).documents()) == ["hello\n"]


def test_a_token_cache_inside_a_jsonl_folder_is_not_a_stray_file(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", DOCS)
    first = load_dataset(folder, folder / "cache", 8, bad_lines="skip")
    second = load_dataset(folder, folder / "cache", 8, bad_lines="skip")
    assert second.path == first.path and second.num_tokens == first.num_tokens
