"""`partita train`'s checks before launch that need the data or the machine: token
counts against the batches, and threads against the cores."""

from __future__ import annotations

import pytest

from partita.commands.train import validate_before_launch
from partita.commands.train_notes import threads_note
from partita.config import load_config
from partita.errors import PartitaError

TINY = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--data.seq_len=32",
        "--train.steps=2"]


def _config(tmp_path, *extra: str):
    src = tmp_path / "small.txt"
    src.write_text("some small text. " * 1200)  # 20,400 bytes
    return load_config(None, [*TINY, f"--data.source={src}", f"--data.cache_dir={tmp_path}",
                              f"--train.out_dir={tmp_path / 'run'}", *extra])


def test_a_validation_split_smaller_than_the_replicas_is_launched(tmp_path):
    """1% of 20 kB at seq_len 128 is one window for two replicas: it was refused (each
    replica needed a window); the second replica now pads its rows with ones that count
    nothing (tests/dist/test_validation_loss.py)."""
    validate_before_launch(_config(tmp_path, "--data.seq_len=128"), 2)


def test_a_global_batch_beyond_the_data_is_refused_before_launch(tmp_path):
    """It was reported by every rank after launch."""
    cfg = _config(tmp_path, "--train.global_batch=100000")
    with pytest.raises(PartitaError, match="fewer than one global batch of 100,000"):
        validate_before_launch(cfg, 2)
    assert not (tmp_path / "run").exists()


def test_threads_beyond_the_cores_are_warned_about(tmp_path):
    """1000 threads on 2 cores ran 200 times slower, silently."""
    cfg = load_config(None, ["--train.threads=1000"])
    note = threads_note(cfg, local_processes=2, cores=2)
    assert note is not None and "2,000 threads for 2 core(s)" in note
    assert "train.threads to at most 1," in note
    assert threads_note(cfg, local_processes=2, cores=4000) is None
    assert threads_note(load_config(None, []), local_processes=2, cores=2) is None  # 0: shared
    assert threads_note(load_config(None, ["--train.threads=1"]), 2, cores=2) is None
    # More processes than cores at one thread each: no thread setting can help, so no
    # advice to set one (it used to say "at most 1" to a run at 1).
    assert threads_note(load_config(None, ["--train.threads=1"]), 4, cores=2) is None
