"""The output folder is checked before launch and never mixes two runs."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import pytest
import torch

from partita import run_dir
from partita.commands.run_folders import check_run_dir, prepare_run_dir
from partita.commands.train_notes import print_notes
from partita.config import load_config
from partita.errors import PartitaError
from partita.run_dir import RESULT_FILES, prepare_folder, prepare_out_dir

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


@pytest.mark.parametrize("name", ["metrics.jsonl", "model.safetensors"])
def test_another_runs_results_are_refused_without_overwrite(tmp_path, name):
    (tmp_path / "config.toml").write_text("old")
    (tmp_path / name).write_text("old")
    with pytest.raises(PartitaError, match="already holds another run's results") as err:
        prepare_out_dir(tmp_path, overwrite=False, bytes_needed=1)
    assert (tmp_path / name).read_text() == "old"  # nothing touched
    # A run with checkpoints is refused earlier, with the resume hint; this one has none.
    assert "--train.resume=auto" not in str(err.value)


def test_a_run_that_died_before_its_first_step_does_not_block_the_folder(tmp_path):
    # What such a run leaves: its config and an empty metrics file, nothing trained.
    (tmp_path / "config.toml").write_text("old")
    (tmp_path / "metrics.jsonl").write_text("")
    prepare_out_dir(tmp_path, overwrite=False, bytes_needed=1)
    assert not (tmp_path / "config.toml").exists()  # replaced by the new run's


def test_overwrite_removes_the_old_results_first(tmp_path):
    for name in RESULT_FILES:
        (tmp_path / name).write_text("old")
    (tmp_path / "events.out.tfevents.1.host").write_text("old")
    (tmp_path / "hf").mkdir()  # the old run's export (train.export=hf)
    (tmp_path / "hf" / "config.json").write_text("old")
    (tmp_path / "notes.txt").write_text("mine")
    prepare_out_dir(tmp_path, overwrite=True, bytes_needed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_half_written_files_are_removed(tmp_path):
    (tmp_path / "model.safetensors.partial").write_bytes(b"\0" * 100)
    (tmp_path / "hf.partial").mkdir()  # an export that was killed
    (tmp_path / "hf.partial" / "config.json").write_text("{}")
    prepare_out_dir(tmp_path, overwrite=False, bytes_needed=1)
    assert not list(tmp_path.iterdir())


def test_too_little_free_space_is_an_error_before_training(tmp_path, monkeypatch):
    class Usage:
        free = 10 << 20
    monkeypatch.setattr(run_dir.shutil, "disk_usage", lambda _p: Usage)
    with pytest.raises(PartitaError, match="MiB free but the run will write"):
        prepare_out_dir(tmp_path, overwrite=False, bytes_needed=100 << 20)


# What save_weights reads of a parallel model beyond the state `full_state_dict` gives.
_ONE_PROCESS = SimpleNamespace(device=torch.device("cpu"))


def test_a_failed_weight_write_leaves_nothing(tmp_path, monkeypatch):
    import torch

    from partita import weights

    def full_disk(*_a, **_k):
        (tmp_path / "model.safetensors.partial").write_bytes(b"\0" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(weights, "full_state_dict", lambda _pm: {"w": torch.ones(2)})
    monkeypatch.setattr(weights, "write_file", full_disk)
    with pytest.raises(PartitaError, match="No space left on device"):
        weights.save_weights(_ONE_PROCESS, tmp_path / "model.safetensors")
    assert not list(tmp_path.iterdir())


def test_weights_land_when_the_run_folder_was_removed_while_it_trained(tmp_path, monkeypatch,
                                                                      capsys):
    """An `rm -rf` of the run's folder mid-run lost the whole trained result at the end,
    with advice to free disk space; the folder is made again and a warning says what
    went with it."""
    import torch
    from safetensors.torch import load_file

    from partita import weights

    monkeypatch.setattr(weights, "full_state_dict", lambda _pm: {"w": torch.ones(2)})
    gone = tmp_path / "run"  # the run made it at launch; a cleanup removed it since
    weights.save_weights(_ONE_PROCESS, gone / "model.safetensors")
    assert load_file(gone / "model.safetensors")["w"].tolist() == [1.0, 1.0]
    assert "was removed while the run trained" in capsys.readouterr().err


def test_a_weight_write_that_fails_for_another_reason_is_not_blamed_on_space(tmp_path,
                                                                           monkeypatch):
    import torch

    from partita import weights

    def refused(*_a, **_k):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(weights, "full_state_dict", lambda _pm: {"w": torch.ones(2)})
    monkeypatch.setattr(weights, "write_file", refused)
    with pytest.raises(PartitaError, match="Permission denied.*can be written") as err:
        weights.save_weights(_ONE_PROCESS, tmp_path / "model.safetensors")
    assert "disk space" not in str(err.value)


def _disk_fills_after(monkeypatch, nbytes: int) -> None:
    """The safetensors writer's writes fail with ENOSPC once `nbytes` are written."""
    import os

    from partita.checkpoint import files

    written = [0]

    def write(fd, data):
        if written[0] + len(data) > nbytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += len(data)
        return os.write(fd, data)

    monkeypatch.setattr(files.os, "write", write)


def test_a_disk_that_fills_during_the_weight_write_is_said_so(tmp_path, monkeypatch):
    """The real writer, not a stand-in: the safetensors package raised its own error
    type here, which was reported as a fault inside partita."""
    import torch

    from partita import weights

    monkeypatch.setattr(weights, "full_state_dict", lambda _pm: {"w": torch.ones(4096)})
    _disk_fills_after(monkeypatch, 1000)
    with pytest.raises(PartitaError, match="writing the weights .* failed .No space left"):
        weights.save_weights(_ONE_PROCESS, tmp_path / "model.safetensors")
    assert not list(tmp_path.iterdir())


def test_a_disk_that_fills_during_an_export_is_said_so(tmp_path, monkeypatch):
    from partita.export import export_hf
    from partita.models.model_config import ModelConfig
    from partita.models.transformer import build_model

    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2)
    state = build_model(cfg).state_dict()
    _disk_fills_after(monkeypatch, 4000)
    with pytest.raises(PartitaError, match="writing the export to .* failed .No space left"):
        export_hf(state, cfg, tmp_path / "hf")
    assert not list(tmp_path.iterdir())


def test_the_weights_file_gets_a_new_files_mode(tmp_path, monkeypatch):
    """The safetensors package writes 0600; the run's weights are readable like its
    other results."""
    import os
    import stat

    import torch

    from partita import weights

    monkeypatch.setattr(weights, "full_state_dict", lambda _pm: {"w": torch.ones(2)})
    old = os.umask(0o022)
    try:
        weights.save_weights(_ONE_PROCESS, tmp_path / "model.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == 0o644


# `partita train` checks every folder it writes into before launch (commands/run_folders.py),
# with the same rules as train.out_dir: a file is not a folder, a missing folder is made,
# one that cannot be written is refused.


def _cfg(tmp_path, *overrides):
    return load_config(None, [f"--train.out_dir={tmp_path / 'run'}", *overrides])


def test_an_empty_out_dir_is_refused_not_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["--train.out_dir="])
    for check in (check_run_dir, prepare_run_dir):
        with pytest.raises(PartitaError, match="train.out_dir is empty.*--train.out_dir="):
            check(cfg)
    with pytest.raises(PartitaError, match="train.out_dir is empty"):
        prepare_out_dir("", overwrite=False, bytes_needed=1)
    assert list(tmp_path.iterdir()) == []  # nothing written into the current folder


def test_a_checkpoint_dir_that_cannot_be_written_is_refused_before_launch(tmp_path):
    cfg = _cfg(tmp_path, "--train.checkpoint_dir=/proc/partita-ckpt",
               "--train.checkpoint_every=5")
    with pytest.raises(PartitaError, match="train.checkpoint_dir '/proc/partita-ckpt' "
                                           "cannot be written"):
        prepare_run_dir(cfg)


def test_a_checkpoint_dir_that_is_a_file_is_refused_and_kept(tmp_path):
    (tmp_path / "ckpt").write_text("mine")
    cfg = _cfg(tmp_path, f"--train.checkpoint_dir={tmp_path / 'ckpt'}")
    for check in (check_run_dir, prepare_run_dir):
        with pytest.raises(PartitaError, match="train.checkpoint_dir .* is a file, not a "
                                               "folder; give the path of a folder"):
            check(cfg)
    assert (tmp_path / "ckpt").read_text() == "mine"


def test_the_default_checkpoint_folder_is_checked_too(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("x")
    with pytest.raises(PartitaError, match=r"OUT_DIR/checkpoints\) .* is a file"):
        check_run_dir(_cfg(tmp_path))


def test_a_missing_checkpoint_dir_is_made_before_launch(tmp_path):
    prepare_run_dir(_cfg(tmp_path, f"--train.checkpoint_dir={tmp_path / 'a' / 'ckpt'}"))
    assert (tmp_path / "a" / "ckpt").is_dir() and (tmp_path / "run").is_dir()


def test_prepare_folder_names_the_setting(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(PartitaError, match="^some.setting '.*' is a file"):
        prepare_folder(tmp_path / "f", "some.setting")
    with pytest.raises(PartitaError, match="^some.setting '.*' cannot be written"):
        prepare_folder(tmp_path / "f" / "below", "some.setting")


def test_the_timeline_folder_is_made_before_launch(tmp_path):
    png = tmp_path / "plots" / "deep" / "t.png"
    prepare_run_dir(_cfg(tmp_path, "--parallel.pp=2", f"--train.timeline_png={png}"))
    assert png.parent.is_dir() and not png.exists()


@pytest.mark.parametrize(("where", "message"), [
    ("/proc/partita-plots/t.png", "the folder of train.timeline_png '/proc/partita-plots' "
                                  "cannot be written"),
    ("afile/t.png", "the folder of train.timeline_png .* is a file"),
    ("adir", "train.timeline_png .* is a folder; give the name of a PNG file"),
])
def test_a_timeline_png_that_cannot_be_written_is_refused_before_launch(tmp_path, where,
                                                                         message):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    png = where if where.startswith("/") else tmp_path / where
    cfg = _cfg(tmp_path, "--parallel.pp=2", f"--train.timeline_png={png}")
    with pytest.raises(PartitaError, match=message):
        prepare_run_dir(cfg)


def test_a_timeline_png_without_matplotlib_is_refused_before_launch(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    cfg = _cfg(tmp_path, "--parallel.pp=2", f"--train.timeline_png={tmp_path / 't.png'}")
    with pytest.raises(PartitaError, match="needs matplotlib"):
        check_run_dir(cfg)


def test_a_timeline_png_without_a_pipeline_gets_one_note(tmp_path, capsys):
    png = tmp_path / "nowhere" / "t.png"
    cfg = _cfg(tmp_path, f"--train.timeline_png={png}")
    prepare_run_dir(cfg)  # pp=1 draws nothing: its folder is neither checked nor made
    assert not png.parent.exists()
    assert capsys.readouterr().err == ""
    print_notes(cfg)
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "note: train.timeline_png" in err and "is ignored" in err and "pp=1" in err
    print_notes(_cfg(tmp_path, "--parallel.pp=2", f"--train.timeline_png={png}"))
    assert capsys.readouterr().err == ""


def test_a_stop_after_that_no_step_reaches_gets_one_note(tmp_path, capsys):
    """train.stop_after beyond train.steps was ignored without a word."""
    print_notes(_cfg(tmp_path, "--train.steps=10", "--train.stop_after=20"))
    err = capsys.readouterr().err
    assert err == ("partita: note: train.stop_after=20 is ignored: the run ends at "
                   "train.steps=10 first.\n")
    for stop in ("5", "10"):  # reached: the run stops there (at 10, with a checkpoint)
        print_notes(_cfg(tmp_path, "--train.steps=10", f"--train.stop_after={stop}"))
        assert capsys.readouterr().err == ""


def test_zero_settings_of_another_stage_get_one_note(tmp_path, capsys):
    """parallel.accumulation (stage 2) and prefetch / keep_gathered (stage 3) were
    ignored without a word at the other stages."""
    print_notes(_cfg(tmp_path, "--parallel.zero_stage=1", "--parallel.accumulation=buffer",
                     "--parallel.prefetch=2"))
    assert capsys.readouterr().err == (
        "partita: note: parallel.accumulation=buffer (a ZeRO stage 2 setting); "
        "parallel.prefetch=2 (a ZeRO stage 3 setting) ignored at parallel.zero_stage=1.\n")
    for args in (("--parallel.zero_stage=2", "--parallel.accumulation=buffer"),
                 ("--parallel.zero_stage=3", "--parallel.keep_gathered=0"),
                 ("--parallel.zero_stage=1",)):
        print_notes(_cfg(tmp_path, *args))
        assert capsys.readouterr().err == "", args


def test_an_export_gets_a_new_files_mode(tmp_path):
    import os
    import stat

    from partita.export import export_hf
    from partita.models.model_config import ModelConfig
    from partita.models.transformer import build_model

    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2)
    old = os.umask(0o022)
    try:
        out = export_hf(build_model(cfg).state_dict(), cfg, tmp_path / "hf")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_checkpoint_export_to_a_read_only_folder_says_so(tmp_path, monkeypatch):
    """On a read-only file system removing the (absent) half-written file fails too;
    that error used to replace the message about the write."""
    import argparse
    import os
    from pathlib import Path

    import torch

    from partita.checkpoint import export, files
    from partita.commands import checkpoint

    def read_only(*_a, **_k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(checkpoint, "_folder", lambda _d: tmp_path)
    monkeypatch.setattr(export, "full_tensors", lambda _f: iter([("w", torch.ones(2))]))
    monkeypatch.setattr(files, "write_file", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    args = argparse.Namespace(dir=str(tmp_path), out=str(tmp_path / "w.safetensors"),
                              overwrite=False)
    with pytest.raises(PartitaError, match="Read-only file system"):
        checkpoint.run_export(args)


def test_a_run_refused_for_its_disk_leaves_no_folders(tmp_path, monkeypatch):
    """The folders made to check the run (out_dir, its checkpoints/) go again when the
    run is refused; a folder that was there before stays."""
    class Usage:
        free = 1 << 20

    monkeypatch.setattr(run_dir.shutil, "disk_usage", lambda _p: Usage)
    with pytest.raises(PartitaError, match="MiB free"):
        prepare_run_dir(_cfg(tmp_path))
    assert not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()
    with pytest.raises(PartitaError, match="MiB free"):
        prepare_run_dir(_cfg(tmp_path))
    assert (tmp_path / "run").is_dir() and not list((tmp_path / "run").iterdir())


def test_an_export_may_not_replace_what_it_is_read_from(tmp_path):
    """`partita export RUN --out RUN --overwrite` replaced the run, checkpoints and all,
    with the export."""
    from partita.export import INDEX, check_not_over_source

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for out in (run, tmp_path, run / "checkpoints"):
        with pytest.raises(PartitaError, match="would replace what it is read from"):
            check_not_over_source(run, out)
    check_not_over_source(run, run / "hf")  # new, inside the run: as train.export writes
    (run / "hf").mkdir()
    (run / "hf" / INDEX).write_text("{}")
    check_not_over_source(run, run / "hf")  # an earlier export, replaced
    check_not_over_source(run, tmp_path / "elsewhere")


def test_a_run_id_is_written_whole_and_read_back(tmp_path):
    assert run_dir.read_run_id(tmp_path) is None  # no run yet
    run_dir.write_run_id(tmp_path, "0123456789ab")
    assert run_dir.read_run_id(tmp_path) == "0123456789ab"
    assert sorted(p.name for p in tmp_path.iterdir()) == [run_dir.RUN_ID_FILE]


def test_new_run_ids_differ_and_a_continued_run_keeps_its_own():
    cpu = torch.device("cpu")
    drawn = {run_dir.run_id_for(None, cpu) for _ in range(20)}
    assert len(drawn) == 20 and all(len(i) == 12 and int(i, 16) >= 0 for i in drawn)
    assert run_dir.run_id_for("0123456789ab", cpu) == "0123456789ab"


@pytest.mark.parametrize("theirs, ours, trained, other", [
    ("aaaa", "bbbb", True, "aaaa"),   # another run's results
    ("aaaa", "aaaa", True, None),     # the same run's
    (None, "bbbb", True, None),       # results of a version that wrote no id: trusted
    ("aaaa", None, True, None),       # a checkpoint of such a version: trusted
    ("aaaa", "bbbb", False, None),    # a run that died before its first step
])
def test_other_run_in_compares_run_ids(tmp_path, theirs, ours, trained, other):
    (tmp_path / "config.toml").write_text("old")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n' if trained else "")
    if theirs:
        run_dir.write_run_id(tmp_path, theirs)
    assert run_dir.other_run_in(tmp_path, ours) == other


def test_a_new_run_removes_the_old_run_id(tmp_path):
    run_dir.write_run_id(tmp_path, "aaaa")
    (tmp_path / "metrics.jsonl").write_text("")
    prepare_out_dir(tmp_path, overwrite=False, bytes_needed=1)
    assert run_dir.read_run_id(tmp_path) is None
