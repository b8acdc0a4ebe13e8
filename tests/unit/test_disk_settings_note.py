"""parallel.offload_dir and parallel.host_memory_budget_gb under an offload mode
without disk were accepted and ignored without a word: only the disk engine reads them
(host offload keeps whole states in host memory, with no budget)."""

from __future__ import annotations

from partita.commands.train_notes import print_notes
from partita.config import load_config


def _cfg(tmp_path, *overrides):
    return load_config(None, [f"--train.out_dir={tmp_path / 'run'}", *overrides])


def test_disk_settings_without_disk_offload_get_one_note(tmp_path, capsys):
    print_notes(_cfg(tmp_path, "--parallel.offload=optimizer", "--parallel.offload_dir=/x",
                     "--parallel.host_memory_budget_gb=0.5"))
    assert capsys.readouterr().err == (
        "partita: note: parallel.offload_dir=/x; parallel.host_memory_budget_gb=0.5 ignored "
        "at parallel.offload=optimizer: only the disk modes (optimizer+disk, "
        "optimizer+params+disk) read them.\n")
    print_notes(_cfg(tmp_path, "--parallel.host_memory_budget_gb=2"))
    assert capsys.readouterr().err == (
        "partita: note: parallel.host_memory_budget_gb=2.0 ignored at parallel.offload=none: "
        "only the disk modes (optimizer+disk, optimizer+params+disk) read them.\n")
    for args in (("--parallel.offload=optimizer+disk", "--parallel.offload_dir=/x",
                  "--parallel.host_memory_budget_gb=0.5"),
                 ("--parallel.offload=optimizer+params+disk", "--parallel.offload_dir=/x",
                  "--parallel.zero_stage=3"),
                 ("--parallel.offload=optimizer+params", "--parallel.zero_stage=3")):
        print_notes(_cfg(tmp_path, *args))
        assert capsys.readouterr().err == "", args
