"""Sources' records and the messages about them: splits of a saved DatasetDict, the
bad_lines policy in cache keys and on cache hits, lone surrogates, byte order marks, a
tokenizer that names no special tokens, data.mix sources (commas in names, missing
paths), a full disk while writing a mixture, and a token cache kept in a source folder."""

from __future__ import annotations

import errno
import json

import numpy as np
import pytest

from partita.config import load_config
from partita.data import load_dataset, read_token_file, text_corpus
from partita.data.dataset import data_notes, load_configured, load_mixture
from partita.data.mix import parse_mix, split_mix
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


def test_bad_lines_keys_a_parquet_cache_and_skips_are_reported_on_a_cache_hit(
        tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": [*DOCS[:30], None, *DOCS[30:]]}),
                   tmp_path / "nulls.parquet")
    skipped = load_dataset(tmp_path / "nulls.parquet", tmp_path / "c", 8, bad_lines="skip")
    assert "skipped 1 bad row(s)" in capsys.readouterr().err
    again = load_dataset(tmp_path / "nulls.parquet", tmp_path / "c", 8, bad_lines="skip")
    assert again.path == skipped.path
    assert "skipped 1 bad row(s)" in capsys.readouterr().err  # said again, from the cache
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


def test_a_tokenizer_without_special_tokens_is_noted(tmp_path):
    pytest.importorskip("tokenizers")
    from tests.unit.test_data_boundaries import make_tokenizer

    make_tokenizer(tmp_path / "tok", "<s>", "</s>")
    (tmp_path / "tok" / "tokenizer_config.json").unlink()
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    cfg = load_config(None, [f"--data.source={src}", f"--data.tokenizer={tmp_path / 'tok'}",
                             "--data.seq_len=8"])
    ds = load_configured(cfg.data, tmp_path / "c")
    assert ds.boundary is None
    [note] = data_notes(cfg.data)  # said before launch (print_notes), once per job
    assert "names no BOS or EOS token" in note


def test_a_mix_source_whose_name_holds_a_comma(tmp_path):
    odd = write_jsonl(tmp_path / "a,b.jsonl", ["a" * 50] * 40)
    plain = write_jsonl(tmp_path / "c.jsonl", ["c" * 50] * 40)
    parts = parse_mix(f"{odd}=3, {plain}=1")
    assert [(p.source, p.weight) for p in parts] == [(str(odd), 0.75), (str(plain), 0.25)]
    assert split_mix(f"x=y.jsonl=1,, {plain} = 2") == [("x=y.jsonl", "1"), (str(plain), "2")]
    toml = tmp_path / "run.toml"
    toml.write_text(f'[data]\nmix = {{"{odd}" = 1, "{plain}" = 1}}\n')
    ds = load_mixture(load_config(toml).data.mix, tmp_path / "c", 8)
    assert {ord("a"), ord("c")} <= set(np.asarray(ds.train).tolist())
    with pytest.raises(PartitaError, match="SOURCE=WEIGHT"):
        parse_mix(f"{tmp_path / 'missing'},x.jsonl=1, {plain}=1")


def test_a_missing_mix_source_is_named_as_one(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", DOCS)
    with pytest.raises(PartitaError, match=r"data.mix source '.*nope.jsonl' does not exist"
                                           r".*leave the source out of data.mix") as info:
        load_mixture(f"{a}=1, {tmp_path / 'nope.jsonl'}=1", tmp_path / "c", 8)
    assert "built-in" not in str(info.value)


def test_every_record_skipped_says_so(tmp_path):
    src = write_jsonl(tmp_path / "bad.jsonl", [], bad={1: "{not json", 2: "[1, 2]"})
    with pytest.raises(PartitaError, match="has 0 tokens because every record was skipped"):
        load_dataset(src, tmp_path / "c", 8, bad_lines="skip")


def test_a_full_disk_while_writing_the_mixture_is_explained(tmp_path, monkeypatch):
    from partita.data import tokenfile

    a = write_jsonl(tmp_path / "a.jsonl", ["a" * 50] * 40)
    b = write_jsonl(tmp_path / "b.jsonl", ["b" * 50] * 40)
    for source in (a, b):  # the sources' caches are written; then the disk fills
        load_dataset(source, tmp_path / "c", 8)

    def full(self, ids):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tokenfile.TokenFileWriter, "write", full)
    with pytest.raises(PartitaError, match=r"Cannot write the mixture file .*No space left"):
        load_mixture(f"{a}=1, {b}=1", tmp_path / "c", 8)
    assert not list((tmp_path / "c").glob("mix-*"))


def test_a_token_cache_inside_a_jsonl_folder_is_not_a_stray_file(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", DOCS)
    first = load_dataset(folder, folder / "cache", 8, bad_lines="skip")
    second = load_dataset(folder, folder / "cache", 8, bad_lines="skip")
    assert second.path == first.path and second.num_tokens == first.num_tokens
