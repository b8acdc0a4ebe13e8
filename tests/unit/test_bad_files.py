"""Every file partita reads, damaged in generated ways, gives one clear error.

Files: the token file (data), the run configuration (TOML) and the weights file.
Damage: truncation at several points, single flipped bytes in the header and the body,
empty files, a newer format version, ids outside the vocabulary, NaN weights, FIFOs in
place of files. Each case asserts a PartitaError that names the file, never a hang or
a raw exception, and that nothing that looks valid is produced.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from partita.config import load_config
from partita.data import load_dataset
from partita.data.tokenfile import HEADER_BYTES, check_token_ids, read_token_file, write_token_file
from partita.errors import PartitaError
from partita.models.catalog import get_model_config
from partita.models.transformer import build_model
from partita.sampling import load_run_model
from partita.weights import load_weights

pytestmark = pytest.mark.fault_suite("damaged files")

VOCAB = 300  # two bytes per id


@pytest.fixture
def token_file(tmp_path):
    ids = np.arange(4000) % VOCAB
    return write_token_file(tmp_path / "tokens.bin", ids, VOCAB)


def _damaged_token_files():
    size = HEADER_BYTES + 4000 * 2
    cases = [("empty", lambda b: b""), ("header only", lambda b: b[:HEADER_BYTES])]
    cases += [(f"truncated at {n}", lambda b, n=n: b[:n]) for n in (1, 8, 31, 33, size - 1)]
    cases += [("one byte longer", lambda b: b + b"\0")]
    # Every header byte flipped in turn: magic, version, width, vocab, count.
    for i in range(HEADER_BYTES):
        cases.append((f"header byte {i} flipped",
                      lambda b, i=i: b[:i] + bytes([b[i] ^ 0xFF]) + b[i + 1:]))
    # An id in the body raised beyond the vocabulary at the start, middle and end.
    for pos in (0, 1999, 3999):
        def bad_id(b, pos=pos):
            at = HEADER_BYTES + 2 * pos
            return b[:at] + struct.pack("<H", VOCAB + 5) + b[at + 2:]
        cases.append((f"id beyond vocabulary at {pos}", bad_id))
    return cases


@pytest.mark.parametrize(("what", "damage"), _damaged_token_files(),
                         ids=[c[0] for c in _damaged_token_files()])
def test_damaged_token_file_is_refused_or_still_exact(token_file, what, damage):
    damaged = damage(token_file.read_bytes())
    token_file.write_bytes(damaged)
    try:
        data, vocab = read_token_file(token_file)
    except PartitaError as exc:
        assert str(token_file) in str(exc)
        return
    # A flipped byte that leaves a consistent file (e.g. a larger vocabulary in the
    # header, or a lower count's high byte) must still read ids within the vocabulary.
    assert vocab >= 1 and (len(data) == 0 or int(np.asarray(data).max()) < vocab), what


def test_a_large_token_file_is_sampled_and_says_how_much(tmp_path):
    ids = np.zeros(200_000, dtype=np.int64)
    ids[123_456] = VOCAB + 1  # not at a sampled spot need not be caught; this one is
    data = np.asarray(ids, dtype=np.uint16)
    scanned = check_token_ids(data[:100_000], VOCAB, tmp_path, full_scan_bytes=64)
    assert scanned <= 64 + 64 * 2  # sampled, not scanned whole
    with pytest.raises(PartitaError, match=r"scanned [\d,]+ of 400,000 bytes"):
        check_token_ids(data, VOCAB, tmp_path, full_scan_bytes=1 << 20)


def test_a_fifo_as_data_source_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(PartitaError, match="neither a regular file nor a folder"):
        load_dataset(str(fifo), tmp_path / "cache", 32)


def test_a_fifo_inside_a_data_folder_is_skipped(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("hello world\n" * 200)
    os.mkfifo(folder / "pipe.txt")
    data = load_dataset(str(folder), tmp_path / "cache", 16)
    assert data.num_tokens == 2400


CONFIG_DAMAGE = {
    "truncated table": "[train\nsteps = 3\n",
    "binary": "\x00\x01\x02garbage",
    "unknown section": "[trian]\nsteps = 3\n",
    "wrong type": "[train]\nsteps = \"many\"\n",
    "out of range": "[train]\nsteps = 0\n",
    "not a table": "train = 3\n",
    "unterminated string": "[data]\nsource = \"abc\n",
}


@pytest.mark.parametrize("what", sorted(CONFIG_DAMAGE))
def test_damaged_config_file_is_one_error(tmp_path, what):
    path = tmp_path / "run.toml"
    path.write_text(CONFIG_DAMAGE[what])
    with pytest.raises(PartitaError):
        load_config(path)


@pytest.fixture
def run_dir(tmp_path):
    cfg = load_config(None, ["--model.name=tiny"])
    model = build_model(get_model_config("tiny"))
    (tmp_path / "config.toml").write_text(cfg.to_toml())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    return tmp_path


def _damaged_weights():
    cases = [("empty", lambda b: b""), ("truncated to 7 bytes", lambda b: b[:7])]
    cases += [(f"truncated at {f:.0%}", lambda b, f=f: b[:int(len(b) * f)])
              for f in (0.01, 0.5, 0.99)]
    cases += [("header length flipped", lambda b: bytes([b[0] ^ 0xFF]) + b[1:]),
              ("header json broken", lambda b: b[:8] + b"}" + b[9:])]
    return cases


@pytest.mark.parametrize(("what", "damage"), _damaged_weights(),
                         ids=[c[0] for c in _damaged_weights()])
def test_damaged_weights_are_refused_by_generate(run_dir, what, damage):
    weights = run_dir / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(PartitaError, match="model.safetensors"):
        load_run_model(run_dir)


def test_nan_weights_are_refused(run_dir):
    weights = run_dir / "model.safetensors"
    state = load_weights(weights)
    state["norm.weight"] = torch.full_like(state["norm.weight"], float("nan"))
    save_file(state, str(weights))
    with pytest.raises(PartitaError, match="NaN or infinite values in norm.weight"):
        load_run_model(run_dir)


def test_weights_of_another_shape_are_refused(run_dir):
    weights = run_dir / "model.safetensors"
    state = load_weights(weights)
    state["norm.weight"] = torch.ones(3)
    save_file(state, str(weights))
    with pytest.raises(PartitaError, match="do not fit the model"):
        load_run_model(run_dir)


def test_a_killed_token_writer_leaves_nothing_the_next_writer_keeps(tmp_path):
    import socket
    import subprocess
    import sys

    target = tmp_path / "tokens.bin"
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".tokens.bin.{host}.{dead}.abc.tmp"
    stale.write_bytes(b"\0" * 64)
    live = tmp_path / f".tokens.bin.{host}.{os.getpid()}.def.tmp"  # this process: alive
    live.write_bytes(b"\0" * 64)
    write_token_file(target, np.arange(10), VOCAB)
    assert not stale.exists() and live.exists()
    assert read_token_file(target)[0].tolist() == list(range(10))
