"""Data pipeline: tokenizer, token files, corpora, cache, splits and the dp sampler."""

from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from partita.data import (
    BatchSampler,
    ByteTokenizer,
    TokenFileWriter,
    Tokenizer,
    cache_path,
    dtype_for_vocab,
    eval_batches,
    load_dataset,
    prepare_tokens,
    read_token_file,
    stdlib_corpus,
    text_corpus,
    write_token_file,
)
from partita.data.tokenfile import HEADER_BYTES
from partita.errors import PartitaError

# --- tokenizer ----------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    for text in ["", "hello\n", "naïve café — ∑ 🎻 partita", "\t\x00\x7f"]:
        ids = tok.encode(text)
        assert ids.dtype == np.uint8 and len(ids) == len(text.encode())
        assert tok.decode(ids) == text
        assert tok.decode(ids.tolist()) == text


def test_byte_tokenizer_decode_cut_character_replaces():
    tok = ByteTokenizer()
    ids = tok.encode("é")[:1]  # half of a two-byte character
    assert tok.decode(ids) == "\ufffd"
    with pytest.raises(ValueError):
        tok.decode([256])


# --- token files --------------------------------------------------------------------


@pytest.mark.parametrize("vocab,dtype", [(256, np.uint8), (257, np.uint16),
                                         (65536, np.uint16), (65537, np.uint32)])
def test_token_file_round_trip(tmp_path, vocab, dtype):
    assert dtype_for_vocab(vocab) == np.dtype(dtype)
    ids = np.array([0, 1, vocab - 1, 7, vocab // 2], dtype=np.int64)
    path = write_token_file(tmp_path / "t.tok", ids, vocab)
    data, got_vocab = read_token_file(path)
    assert got_vocab == vocab and data.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(data, ids)
    assert path.stat().st_size == HEADER_BYTES + len(ids) * np.dtype(dtype).itemsize
    assert path.stat().st_mode & 0o444 == 0o444  # readable by other users of a shared cache


def test_token_file_empty_and_out_of_vocab(tmp_path):
    data, vocab = read_token_file(write_token_file(tmp_path / "e.tok", np.zeros(0), 10))
    assert len(data) == 0 and vocab == 10
    with pytest.raises(ValueError):
        write_token_file(tmp_path / "bad.tok", np.array([10]), 10)
    assert not (tmp_path / "bad.tok").exists()


def test_writer_failure_publishes_nothing(tmp_path):
    with pytest.raises(RuntimeError), TokenFileWriter(tmp_path / "x.tok", 256) as w:
        w.write(np.arange(100))
        raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []  # neither the final file nor a temp file


def _corrupt(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "magic":
        raw[:4] = b"JUNK"
    elif how == "truncated":
        raw = raw[:-3]
    elif how == "trailing":
        raw += b"\0\0"
    elif how == "count":
        raw[24:32] = struct.pack("<Q", 10_000)
    elif how == "version":
        raw[8:12] = struct.pack("<I", 99)
    elif how == "header_cut":
        raw = raw[:10]
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how,words", [("magic", "not a partita token file"),
                                       ("truncated", "truncated"), ("trailing", "longer"),
                                       ("count", "truncated"), ("version", "version 99"),
                                       ("header_cut", "not a partita token file")])
def test_corrupt_token_file_errors(tmp_path, how, words):
    path = write_token_file(tmp_path / "c.tok", np.arange(50), 256)
    _corrupt(path, how)
    with pytest.raises(PartitaError, match=words) as info:
        read_token_file(path)
    assert "Delete" in str(info.value)  # the message says how to fix it


def test_missing_paths_error(tmp_path):
    with pytest.raises(PartitaError, match="Cannot read token file"):
        read_token_file(tmp_path / "nope.tok")
    with pytest.raises(PartitaError, match="does not exist"):
        load_dataset(tmp_path / "no_such_dir", tmp_path / "cache", seq_len=8)


# --- corpora ------------------------------------------------------------------------


def test_stdlib_corpus_budget_and_order():
    corpus = stdlib_corpus(max_bytes=50_000)
    assert corpus.num_bytes == 50_000
    paths = [f.path for f in corpus.files]
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in paths)
    assert stdlib_corpus(max_bytes=50_000).fingerprint() == corpus.fingerprint()
    assert stdlib_corpus(max_bytes=50_001).fingerprint() != corpus.fingerprint()


def test_text_folder_rule(tmp_path):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.md").write_text("# title\n")
    (root / "sub" / "b.py").write_text("x = 1\n")
    (root / "README").write_text("plain, no extension\n")
    (root / ".git" / "config").write_text("hidden\n")
    (root / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    write_token_file(root / "tokens.tok", np.arange(10), 256)
    (root / "long.txt").write_text("x" * 8191 + "é")  # sniff window cuts the character
    names = [f.path.name for f in text_corpus(root).files]
    assert names == ["README", "a.md", "long.txt", "b.py"]  # sorted walk: files, then subfolders
    with pytest.raises(PartitaError, match="neither UTF-8 text"):
        text_corpus(root / "img.png")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PartitaError, match="no non-empty text files"):
        text_corpus(tmp_path / "empty")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(PartitaError, match="Data file '.*empty.txt' is empty"):
        text_corpus(tmp_path / "empty.txt")


# --- cache --------------------------------------------------------------------------


def test_cache_reuse_and_invalidation(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n" * 20)
    cache = tmp_path / "cache"
    first = load_dataset(src, cache, seq_len=8).path
    stamp = first.stat().st_mtime_ns
    again = load_dataset(src, cache, seq_len=8)
    assert again.path == first and first.stat().st_mtime_ns == stamp  # reused, not rewritten

    (src / "a.txt").write_text("hello world\n" * 21)  # size changes
    changed = load_dataset(src, cache, seq_len=8)
    assert changed.path != first and changed.num_tokens == 12 * 21
    st = (src / "a.txt").stat()
    os.utime(src / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # only mtime
    assert load_dataset(src, cache, seq_len=8).path not in (first, changed.path)
    (src / "b.txt").write_text("new file\n")
    assert text_corpus(src).fingerprint() != text_corpus(src / "a.txt").fingerprint()

    class OtherTokenizer(ByteTokenizer):
        name = "bytes-other"

    corpus = text_corpus(src)
    assert cache_path(corpus, OtherTokenizer(), cache) != cache_path(corpus, ByteTokenizer(),
                                                                      cache)


def test_concurrent_prepare_is_harmless(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("abcdefgh" * 5000)
    corpus, cache = text_corpus(src), tmp_path / "cache"
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: prepare_tokens(corpus, ByteTokenizer(), cache),
                              range(4)))
    assert len(set(paths)) == 1
    data, _ = read_token_file(paths[0])
    assert ByteTokenizer().decode(data) == src.read_text()
    assert [p.name for p in cache.iterdir()] == [paths[0].name]  # no temp files left


def test_load_dataset_builtin_and_token_file(tmp_path):
    ds = load_dataset(None, tmp_path, seq_len=16, max_bytes=20_000, val_fraction=0.05)
    assert ds.vocab_size == 256 and ds.num_tokens == 20_000
    assert len(ds.val) == 1000 and ds.tokenizer.decode(ds.train[:4]) != ""
    tokfile = write_token_file(tmp_path / "mine.tok", np.arange(3000) % 1000, 1000)
    own = load_dataset(tokfile, tmp_path / "unused", seq_len=16, val_fraction=0.0)
    assert own.vocab_size == 1000 and own.path == tokfile and len(own.val) == 0
    assert not (tmp_path / "unused").exists()  # used in place, nothing cached


def test_split_sizes_and_errors(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("x" * 100)
    ds = load_dataset(src, tmp_path, seq_len=32, val_fraction=0.01)
    assert len(ds.val) == 33 and len(ds.train) == 67  # at least one window held out
    with pytest.raises(PartitaError, match="too few for seq_len"):
        load_dataset(src, tmp_path, seq_len=60)
    with pytest.raises(PartitaError, match="val_fraction"):
        load_dataset(src, tmp_path, seq_len=8, val_fraction=1.0)


# --- sampler ------------------------------------------------------------------------

L = 4  # seq_len in sampler tests
TOKENS = np.arange(4 * 50 + 1, dtype=np.uint32)  # 50 windows; window w starts at token w*L


def _windows(inputs: torch.Tensor) -> list[int]:
    return (inputs[:, 0] // L).tolist()


def test_sampler_shapes_and_targets():
    s = BatchSampler(TOKENS, L, global_batch=8, dp_rank=1, dp_size=2)
    x, y = next(s)
    assert x.shape == y.shape == (4, L) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one token


def test_sampler_epoch_coverage_across_dp_ranks():
    G, D = 12, 3
    samplers = [BatchSampler(TOKENS, L, G, r, D, seed=5) for r in range(D)]
    steps = samplers[0].steps_per_epoch
    assert steps == 4  # 50 windows, 48 used, 2 dropped
    seen = []
    for _ in range(steps):
        rows = [_windows(next(s)[0]) for s in samplers]
        assert all(len(r) == G // D for r in rows)
        seen += [w for r in rows for w in r]
    assert len(seen) == len(set(seen)) == steps * G  # no window twice in an epoch
    dropped = set(range(50)) - set(seen)
    assert dropped == set(samplers[0].permutation(0)[steps * G:].tolist())
    assert samplers[0].epoch == 1 and samplers[0].step == 0
    assert _windows(next(samplers[0])[0]) != _windows(samplers[0].batch(0, 0)[0])


def test_sampler_deterministic_and_seeded():
    a = BatchSampler(TOKENS, L, 8, 1, 2, seed=3)
    b = BatchSampler(TOKENS, L, 8, 1, 2, seed=3)
    for _ in range(15):  # crosses epoch boundaries (6 steps per epoch)
        xa, xb = next(a)[0], next(b)[0]
        assert torch.equal(xa, xb)
    c = BatchSampler(TOKENS, L, 8, 1, 2, seed=4)
    assert not np.array_equal(c.permutation(0), a.permutation(0))
    assert not np.array_equal(a.permutation(0), a.permutation(1))


def test_sampler_resume_mid_epoch_matches_uninterrupted():
    ref = BatchSampler(TOKENS, L, 8, 0, 2, seed=1)
    expected = [next(ref) for _ in range(14)]
    first = BatchSampler(TOKENS, L, 8, 0, 2, seed=1)
    for _ in range(9):
        next(first)
    state = first.state_dict()
    assert (state["epoch"], state["step"]) == (1, 3)
    resumed = BatchSampler(TOKENS, L, 8, 0, 2, seed=1)
    resumed.load_state_dict(state)
    for want in expected[9:]:
        got = next(resumed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_sampler_resume_with_other_dp_size():
    G = 8
    reference = BatchSampler(TOKENS, L, G, 0, 1, seed=2)
    want = [next(reference)[0] for _ in range(10)]
    old = [BatchSampler(TOKENS, L, G, r, 2, seed=2) for r in range(2)]
    for _ in range(4):
        for s in old:
            next(s)
    state = old[0].state_dict()
    new = [BatchSampler(TOKENS, L, G, r, 4, seed=2) for r in range(4)]
    for s in new:
        s.load_state_dict(state)
    for step in range(4, 10):
        assert torch.equal(torch.cat([next(s)[0] for s in new]), want[step])


def test_sampler_errors():
    with pytest.raises(PartitaError, match="cannot be split evenly"):
        BatchSampler(TOKENS, L, 10, 0, 4)
    with pytest.raises(PartitaError, match="dp_rank"):
        BatchSampler(TOKENS, L, 8, 2, 2)
    with pytest.raises(PartitaError, match="fewer than one global batch"):
        BatchSampler(TOKENS, L, 64)
    state = BatchSampler(TOKENS, L, 8).state_dict()
    with pytest.raises(PartitaError, match="seq_len=4"):
        BatchSampler(TOKENS, 5, 8).load_state_dict(state)


def test_eval_batches_fixed_and_split():
    whole = list(eval_batches(TOKENS, L, 8, max_batches=3))
    assert [_windows(x) for x, _ in whole] == [list(range(b * 8, b * 8 + 8)) for b in range(3)]
    parts = [list(eval_batches(TOKENS, L, 8, r, 4)) for r in range(4)]
    assert len(parts[0]) == 7  # 50 windows -> 6 full batches and one of the last 2
    for b in range(6):
        assert torch.equal(torch.cat([p[b][0] for p in parts]), list(eval_batches(
            TOKENS, L, 8))[b][0])
    assert list(eval_batches(TOKENS[:0], L, 8)) == []
