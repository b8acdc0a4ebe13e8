"""What a source turns into before training, and the source mistakes refused with a
reason: how records are separated and framed (and so keyed in the cache), bad records
in JSONL and Parquet, folders mixing kinds, tokenizer configs naming unknown tokens,
mix weights, a cache folder that is a file, and token counts too small for the batches."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from partita.data import ByteTokenizer, load_dataset
from partita.data.dataset import cache_path, open_corpus
from partita.data.mix import parse_mix
from partita.data.sampler import BatchSampler
from partita.errors import AgreedError, PartitaError


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


# --- record boundaries and the cache key ---------------------------------------------

def test_records_end_with_a_newline_under_the_byte_tokenizer(tmp_path):
    """JSONL records were written back to back: 'record number 0.record number 1.'."""
    src = write_jsonl(tmp_path / "r.jsonl", ["record number 0.", "record number 1.",
                                             "ends with its own\n", "last"])
    ds = load_dataset(src, tmp_path / "c", 4, val_fraction=0)
    assert ByteTokenizer().decode(ds.train) == ("record number 0.\nrecord number 1.\n"
                                                "ends with its own\nlast\n")
    # Text files are documents as they are: nothing is added to them.
    text = tmp_path / "t.txt"
    text.write_text("no newline at the end")
    plain = load_dataset(text, tmp_path / "c", 4, val_fraction=0)
    assert ByteTokenizer().decode(plain.train) == "no newline at the end"


def test_parquet_rows_are_records_too(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["one", "two"]}), tmp_path / "p.parquet")
    ds = load_dataset(tmp_path / "p.parquet", tmp_path / "c", 2, val_fraction=0)
    assert ByteTokenizer().decode(ds.train) == "one\ntwo\n"


def _bpe(folder, config: dict | None = None):
    """A small BPE tokenizer.json with <s> and </s> in its vocabulary, and optionally a
    tokenizer_config.json beside it."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    docs = [f"record number {i} of the corpus" for i in range(50)]
    tok.train_from_iterator(docs, tokenizers.trainers.BpeTrainer(
        vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"]))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_bos_and_eos_are_part_of_the_cache_key(tmp_path):
    """A folder with tokenizer_config.json (BOS/EOS) and the same tokenizer.json alone
    shared one cache file, so framing and masking depended on which ran first."""
    from partita.data.hf_tokenizer import HFTokenizer

    framed = HFTokenizer(_bpe(tmp_path / "framed", {"bos_token": "<s>", "eos_token": "</s>"}))
    bare_dir = tmp_path / "bare"
    bare_dir.mkdir()
    shutil.copy(tmp_path / "framed" / "tokenizer.json", bare_dir / "tokenizer.json")
    bare = HFTokenizer(bare_dir / "tokenizer.json")
    assert framed.name == bare.name  # the same tokenizer.json
    src = write_jsonl(tmp_path / "r.jsonl", [f"record number {i}" for i in range(40)])
    corpus = open_corpus(str(src))
    assert cache_path(corpus, framed, tmp_path) != cache_path(corpus, bare, tmp_path)
    one = load_dataset(src, tmp_path / "c", 4, tokenizer=bare, val_fraction=0)
    two = load_dataset(src, tmp_path / "c", 4, tokenizer=framed, val_fraction=0)
    assert one.path != two.path
    assert (np.asarray(two.train) == framed.eos_id).sum() == 40
    assert (np.asarray(one.train) == framed.eos_id).sum() == 0
    # Without EOS each record is encoded with a newline after it, as under the byte
    # tokenizer (this tokenizer's pre-tokenizer then splits there).
    expected = np.concatenate([bare.encode(f"record number {i}\n") for i in range(40)])
    assert np.array_equal(np.asarray(one.train), expected)


def test_a_special_token_missing_from_the_vocabulary_is_refused(tmp_path):
    from partita.data.hf_tokenizer import HFTokenizer

    for key in ("eos_token", "bos_token"):
        folder = _bpe(tmp_path / key, {"bos_token": "<s>", "eos_token": "</s>",
                                       key: "<not-there>"})
        with pytest.raises(PartitaError, match=f"names {key} '<not-there>', which is not in "
                                               "the vocabulary"):
            HFTokenizer(folder)


# --- bad records -----------------------------------------------------------------------

def test_invalid_utf8_in_jsonl_is_a_bad_line(tmp_path, capsys):
    """It was replaced with U+FFFD silently, while a text file with it is refused."""
    src = tmp_path / "r.jsonl"
    src.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n{"text": "also fine"}\n')
    with pytest.raises(PartitaError, match=r"r.jsonl' line 2: not UTF-8 \(byte 0xe9.*"
                                           "bad_lines=skip"):
        load_dataset(src, tmp_path / "c", 2, val_fraction=0)
    assert not list((tmp_path / "c").glob("*.tok"))
    ds = load_dataset(src, tmp_path / "c", 2, val_fraction=0, bad_lines="skip")
    assert ByteTokenizer().decode(ds.train) == "fine\nalso fine\n"
    assert "skipped 1 bad line(s)" in capsys.readouterr().err


def test_a_parquet_text_column_that_is_not_strings_is_named(tmp_path):
    """A binary column failed with "the data has 0 tokens"."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": [b"bytes", b"more"]}), tmp_path / "b.parquet")
    with pytest.raises(PartitaError, match="column 'text' holds binary, not text"):
        load_dataset(tmp_path / "b.parquet", tmp_path / "c", 2)


def test_null_parquet_rows_follow_the_bad_lines_policy(tmp_path, capsys):
    """They were dropped without a word."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["one", None, "three", None]}), tmp_path / "n.parquet")
    with pytest.raises(PartitaError, match=r"n.parquet' row 2: 'text' is null.*bad_lines=skip"):
        load_dataset(tmp_path / "n.parquet", tmp_path / "c", 2, val_fraction=0)
    ds = load_dataset(tmp_path / "n.parquet", tmp_path / "c", 2, val_fraction=0,
                      bad_lines="skip")
    assert ByteTokenizer().decode(ds.train) == "one\nthree\n"
    assert "skipped 2 bad row(s)" in capsys.readouterr().err


def test_a_folder_mixing_jsonl_with_other_files_is_refused(tmp_path):
    """It was read as plain text, training on the raw JSON."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ["a record"] * 20)
    (folder / "README.txt").write_text("about this data\n")
    (folder / ".hidden").write_text("ignored like everywhere else")
    with pytest.raises(PartitaError, match=r"mixes 1 JSONL file\(s\) with 1 other file\(s\): "
                                           "README.txt"):
        load_dataset(folder, tmp_path / "c", 2)
    (folder / "README.txt").unlink()
    assert ByteTokenizer().decode(load_dataset(folder, tmp_path / "c", 2,
                                               val_fraction=0).train).startswith("a record\n")


# --- mix weights, the cache folder -----------------------------------------------------

@pytest.mark.parametrize("weight", ["inf", "nan", "-1", "0"])
def test_a_mix_weight_must_be_positive_and_finite(weight):
    with pytest.raises(PartitaError, match="positive, finite weight"):
        parse_mix(f"a.jsonl={weight}, b.jsonl=1")


def test_huge_mix_weights_are_relative_not_infinite():
    """1e308 + 1e308 summed to infinity and every source got 0 tokens."""
    assert [p.weight for p in parse_mix("a=1e308, b=1e308")] == [0.5, 0.5]
    with pytest.raises(PartitaError, match="would contribute no tokens"):
        parse_mix("a=1e-320, b=1e300")


def test_a_cache_dir_that_is_a_file_is_named_as_such(tmp_path):
    """It gave "Cannot write the token cache '.../afile/a-....tok': File exists"."""
    src = tmp_path / "t.txt"
    src.write_text("some text " * 20)
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(PartitaError, match=r"data.cache_dir '.*afile' is a file, not a folder"):
        load_dataset(src, afile, 4)
    with pytest.raises(PartitaError, match=r"cache_dir '.*afile/sub' lies under the file"):
        load_dataset(src, afile / "sub", 4)


# --- token counts against the batches --------------------------------------------------

def test_too_few_windows_for_the_batches_are_found_from_the_dataset(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("x" * 2000)
    ds = load_dataset(src, tmp_path / "c", 16, val_fraction=0.02)  # 40 held out: 2 windows
    ds.check_batches(global_batch=8)
    with pytest.raises(PartitaError, match="fewer than one global batch of 200"):
        ds.check_batches(global_batch=200)


def test_every_rank_finds_too_few_windows_alike_so_one_reports_it():
    with pytest.raises(AgreedError, match="fewer than one global batch"):
        BatchSampler(np.arange(100), 4, 1000, 0, 2)
