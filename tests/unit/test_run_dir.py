"""The output folder is checked before launch and never mixes two runs."""

from __future__ import annotations

import errno

import pytest

from partita import run_dir
from partita.errors import PartitaError
from partita.run_dir import RESULT_FILES, prepare_out_dir

pytestmark = pytest.mark.fault_suite("output folder")


def test_a_new_folder_is_created(tmp_path):
    path = prepare_out_dir(tmp_path / "a" / "b", overwrite=False, bytes_needed=1)
    assert path.is_dir() and list(path.iterdir()) == []


def test_a_file_is_not_a_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(PartitaError, match="is a file, not a folder"):
        prepare_out_dir(tmp_path / "f", overwrite=False, bytes_needed=1)


def test_an_unwritable_place_is_refused():
    with pytest.raises(PartitaError, match="cannot be written"):
        prepare_out_dir("/proc/partita-run", overwrite=False, bytes_needed=1)


@pytest.mark.parametrize("name", RESULT_FILES)
def test_another_runs_results_are_refused_without_overwrite(tmp_path, name):
    (tmp_path / name).write_text("old")
    with pytest.raises(PartitaError, match="already holds another run's results"):
        prepare_out_dir(tmp_path, overwrite=False, bytes_needed=1)
    assert (tmp_path / name).read_text() == "old"  # nothing touched


def test_overwrite_removes_the_old_results_first(tmp_path):
    for name in RESULT_FILES:
        (tmp_path / name).write_text("old")
    (tmp_path / "events.out.tfevents.1.host").write_text("old")
    (tmp_path / "notes.txt").write_text("mine")
    prepare_out_dir(tmp_path, overwrite=True, bytes_needed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_half_written_files_are_removed(tmp_path):
    (tmp_path / "model.safetensors.partial").write_bytes(b"\0" * 100)
    prepare_out_dir(tmp_path, overwrite=False, bytes_needed=1)
    assert not list(tmp_path.iterdir())


def test_too_little_free_space_is_an_error_before_training(tmp_path, monkeypatch):
    class Usage:
        free = 10 << 20
    monkeypatch.setattr(run_dir.shutil, "disk_usage", lambda _p: Usage)
    with pytest.raises(PartitaError, match="MiB free but the run will write"):
        prepare_out_dir(tmp_path, overwrite=False, bytes_needed=100 << 20)


def test_a_failed_weight_write_leaves_nothing(tmp_path, monkeypatch):
    import torch

    from partita import weights

    def full_disk(*_a, **_k):
        (tmp_path / "model.safetensors.partial").write_bytes(b"\0" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(weights, "full_state_dict", lambda _pm: {"w": torch.ones(2)})
    monkeypatch.setattr(weights, "save_file", full_disk)
    with pytest.raises(PartitaError, match="No space left on device"):
        weights.save_weights(None, tmp_path / "model.safetensors")
    assert not list(tmp_path.iterdir())


def test_the_weights_file_gets_a_new_files_mode(tmp_path, monkeypatch):
    """safetensors writes 0600; the run's weights are readable like its other results."""
    import os
    import stat

    import torch

    from partita import weights

    monkeypatch.setattr(weights, "full_state_dict", lambda _pm: {"w": torch.ones(2)})
    old = os.umask(0o022)
    try:
        weights.save_weights(None, tmp_path / "model.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == 0o644
