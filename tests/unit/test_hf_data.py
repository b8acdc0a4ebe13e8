"""Real tokenizers and structured text sources: `data.tokenizer` (tokenizers library,
parallel workers, hash in the cache key, 32-bit ids past 65,536, BOS/EOS between
documents), JSONL / Parquet / saved `datasets` sources, `data.mix`, and document
boundaries in the loss's targets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from partita.config import load_config
from partita.data import load_dataset, read_token_file
from partita.data.dataset import load_configured, load_mixture
from partita.data.mix import parse_mix
from partita.data.sampler import IGNORE_INDEX, windows_to_batch
from partita.errors import PartitaError

tokenizers = pytest.importorskip("tokenizers")

DOCS = [f"document {i} says hello world number {i * 7 % 13}" for i in range(200)]


def make_tokenizer(folder, extra_vocab: int = 0):
    """A small BPE tokenizer with <s> and </s>, saved as tokenizer.json + config."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    if extra_vocab:
        tok.add_tokens([f"tok{i}" for i in range(extra_vocab)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def write_jsonl(path, docs, bad: dict[int, str] | None = None):
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)]
    for lineno, text in (bad or {}).items():
        lines.insert(lineno - 1, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tokenizer_frames_documents_and_keys_the_cache(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    cfg = load_config(None, [f"--data.source={src}", f"--data.tokenizer={tok_dir}",
                             "--data.seq_len=16", f"--data.cache_dir={tmp_path / 'c1'}",
                             "--data.workers=1"])
    one = load_configured(cfg.data, tmp_path / "c1")
    a, _ = read_token_file(one.path)
    bos, eos = one.tokenizer.bos_id, one.tokenizer.eos_id
    assert (a == bos).sum() == len(DOCS) == (a == eos).sum()
    assert a[0] == bos and a[-1] == eos
    first_end = int(np.argmax(a == eos))
    assert one.tokenizer.decode(a[1:first_end]).replace(" ", "") == DOCS[0].replace(" ", "")
    # The tokenizer's hash is in the cache key: another tokenizer, another file.
    other = make_tokenizer(tmp_path / "tok2", extra_vocab=3)
    cfg.data.tokenizer = str(other)
    assert load_configured(cfg.data, tmp_path / "c1").path != one.path


def test_vocabulary_past_65536_is_stored_in_32_bits(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok", extra_vocab=66000)
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS[:50] + ["tok65999 tok3"])
    cfg = load_config(None, [f"--data.source={src}", f"--data.tokenizer={tok_dir}",
                             "--data.seq_len=8", "--data.workers=1"])
    ds = load_configured(cfg.data, tmp_path / "cache")
    tokens, vocab = read_token_file(ds.path)
    assert vocab > 65536 and tokens.dtype == np.uint32
    assert tokens.max() >= 65536


def test_targets_after_an_end_of_document_are_not_trained():
    tokens = np.array([1, 5, 6, 2, 1, 7, 8, 2, 1, 9], dtype=np.uint16)  # <s> .. </s>
    inputs, targets = windows_to_batch(tokens, np.array([0]), 9, boundary=2)
    assert targets.tolist()[0] == [5, 6, 2, IGNORE_INDEX, 7, 8, 2, IGNORE_INDEX, 9]
    _, plain = windows_to_batch(tokens, np.array([0]), 9)
    assert plain.tolist()[0] == tokens[1:].tolist()


def test_bad_jsonl_line_is_an_error_with_its_line_number_or_skipped(tmp_path, capsys):
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS[:40], bad={7: "{not json"})
    with pytest.raises(PartitaError, match=r"docs.jsonl' line 7: not JSON.*bad_lines=skip"):
        load_dataset(src, tmp_path / "c", 8)
    assert not list((tmp_path / "c").glob("*.tok"))  # nothing half-written is kept
    ds = load_dataset(src, tmp_path / "c", 8, bad_lines="skip")
    assert "skipped 1 bad line(s)" in capsys.readouterr().err
    assert ds.num_tokens == sum(len(d.encode()) + 1 for d in DOCS[:40])  # + newlines
    wrong_field = write_jsonl(tmp_path / "other.jsonl", DOCS[:5])
    with pytest.raises(PartitaError, match="line 1: no string field 'body'"):
        load_dataset(wrong_field, tmp_path / "c", 8, text_field="body")


def test_parquet_and_saved_dataset_sources(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"content": DOCS, "n": list(range(len(DOCS)))})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=17)
    ds = load_dataset(tmp_path / "docs.parquet", tmp_path / "c", 8, text_field="content")
    assert ds.num_tokens == sum(len(d.encode()) + 1 for d in DOCS)  # + newlines
    with pytest.raises(PartitaError, match=r"docs.parquet' has no column 'text'.*content, n"):
        load_dataset(tmp_path / "docs.parquet", tmp_path / "c", 8)
    datasets = pytest.importorskip("datasets")
    from datasets.table import InMemoryTable

    # An explicit fingerprint: datasets' own hasher (dill) fails on some pyarrow builds.
    saved_ds = datasets.Dataset(InMemoryTable(pa.table({"text": DOCS})), fingerprint="f" * 16)
    saved_ds.save_to_disk(str(tmp_path / "saved"))
    saved = load_dataset(tmp_path / "saved", tmp_path / "c", 8)
    assert np.array_equal(np.asarray(saved.train), np.asarray(ds.train))


def test_mix_takes_sources_in_proportion_and_is_deterministic(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ["a" * 100] * 50)
    b = write_jsonl(tmp_path / "b.jsonl", ["b" * 100] * 10)
    mix = f"{a}=0.75, {b}=0.25"
    ds = load_mixture(mix, tmp_path / "c", 8, val_fraction=0.1)
    train = np.asarray(ds.train)
    share_b = (train == ord("b")).sum() / len(train)
    assert abs(share_b - 0.25) < 0.01  # b (1/6 of the text) upsampled to a quarter
    assert set(np.asarray(ds.val).tolist()) == {ord("a"), ord("b"), ord("\n")}  # both validate
    again = load_mixture(mix, tmp_path / "c", 8, val_fraction=0.1)
    assert again.path == ds.path and np.array_equal(np.asarray(again.train), train)
    toml = tmp_path / "run.toml"
    toml.write_text(f'[data]\nmix = {{"{a}" = 3, "{b}" = 1}}\n')
    parts = parse_mix(load_config(toml).data.mix)
    assert [p.weight for p in parts] == [0.75, 0.25]
    with pytest.raises(PartitaError, match="SOURCE=WEIGHT"):
        parse_mix(f"{a}=0.5, {b}")
    # A source too small for one window is named, not "the data".
    tiny = write_jsonl(tmp_path / "tiny.jsonl", ["xy"])
    with pytest.raises(PartitaError, match=f"data.mix source '{tiny}' has .* too few"):
        load_mixture(f"{a}=0.5, {tiny}=0.5", tmp_path / "c", 8, val_fraction=0.1)


def test_tokenizer_larger_than_the_model_is_refused(tmp_path):
    from partita.trainer import open_dataset

    tok_dir = make_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    cfg = load_config(None, [f"--data.source={src}", f"--data.tokenizer={tok_dir}",
                             "--model.vocab_size=64", f"--data.cache_dir={tmp_path}",
                             "--data.workers=1", "--data.seq_len=16"])
    with pytest.raises(PartitaError, match="tokenizer '.*tok' uses 12[0-9] token ids but "
                                           "the model's vocabulary has 64"):
        open_dataset(cfg)


def test_jsonl_streams_documents_before_reading_the_whole_file(tmp_path):
    from partita.data.sources import JsonlCorpus

    src = write_jsonl(tmp_path / "docs.jsonl", DOCS, bad={len(DOCS): "{broken"})
    docs = JsonlCorpus(src, "text").documents()
    assert next(docs) == DOCS[0]  # read before the bad line near the end is reached
    with pytest.raises(PartitaError, match=f"line {len(DOCS)}: not JSON"):
        list(docs)


def test_a_large_text_file_streams_in_pieces_as_one_document(tmp_path, monkeypatch):
    """A text file above PIECE_BYTES is read piece by piece (never whole), cut after
    newlines, and framed once: one BOS, one EOS, the same bytes as read whole."""
    import pickle

    from partita.data import corpus as corpus_module
    from partita.data.dataset import open_corpus, prepare_tokens
    from partita.data.tokenizer import ByteTokenizer

    monkeypatch.setattr(corpus_module, "PIECE_BYTES", 64)
    text = "".join(f"line {i}: caf\u00e9 \u2014 {'x' * (i % 7)}\n" for i in range(60)) + "no newline"
    src = tmp_path / "big.txt"
    src.write_text(text, encoding="utf-8")
    pieces = list(open_corpus(str(src)).documents())
    assert len(pieces) > 20 and "".join(pieces) == text
    assert max(len(p.encode()) for p in pieces) <= 64 + 40  # a piece and a carried line
    assert all(p.endswith("\n") for p in pieces[:-1])
    assert [(p.opens, p.closes) for p in (pieces[0], pieces[1], pieces[-1])] == [
        (True, False), (False, False), (False, True)]
    again = pickle.loads(pickle.dumps(pieces[0]))  # as it travels to a worker process
    assert again == pieces[0] and again.opens and not again.closes
    byte_path = prepare_tokens(open_corpus(str(src)), ByteTokenizer(), tmp_path / "c0")
    assert read_token_file(byte_path)[0].tobytes() == text.encode()
    tok_dir = make_tokenizer(tmp_path / "tok")
    cfg = load_config(None, [f"--data.source={src}", f"--data.tokenizer={tok_dir}",
                             "--data.seq_len=8", "--data.workers=2"])
    data = load_configured(cfg.data, tmp_path / "c1")
    tokens = read_token_file(data.path)[0]
    assert (tokens == data.tokenizer.bos_id).sum() == 1 == (tokens == data.tokenizer.eos_id).sum()
    assert tokens[0] == data.tokenizer.bos_id and tokens[-1] == data.tokenizer.eos_id
