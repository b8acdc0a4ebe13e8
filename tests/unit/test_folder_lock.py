"""One job at a time in a run's folders (`partita.folder_lock`): a second job for a
folder that a live job holds is refused before it changes anything, naming the holder;
the lock goes with the process that held it, however it ends."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from partita.commands.run_folders import check_run_dir, prepare_run_dir
from partita.config import load_config
from partita.errors import PartitaError
from partita.folder_lock import LOCK_FILE, check_not_in_use, lock_folder

pytestmark = pytest.mark.fault_suite("output folder")


def _cfg(out_dir, *overrides: str):
    return load_config(None, [f"--train.out_dir={out_dir}", *overrides])


def _earlier_run(out_dir):
    """A finished run's results and checkpoints, as a live job would have them."""
    (out_dir / "checkpoints" / "step-00000010").mkdir(parents=True)
    (out_dir / "config.toml").write_text("old")
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    return sorted(p.relative_to(out_dir) for p in out_dir.rglob("*"))


def test_a_second_job_in_a_held_folder_is_refused_and_changes_nothing(tmp_path):
    """Two jobs in one out_dir mixed config, checkpoints and metrics, and a resume
    started while the first job ran deleted its checkpoint in progress."""
    out = tmp_path / "run"
    out.mkdir()
    held = lock_folder(out, "train.out_dir")
    before = _earlier_run(out)
    for overrides in (["--train.overwrite=true"], ["--train.resume=auto"], []):
        with pytest.raises(PartitaError, match=r"train.out_dir '.*run' is in use by another "
                                               r"partita job \(pid \d+ on "):
            prepare_run_dir(_cfg(out, *overrides))
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    held.close()  # the job ends: the folder is free
    check_not_in_use(out, "train.out_dir")


def test_a_checkpoint_dir_inside_a_held_out_dir_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    held = lock_folder(out, "train.out_dir")
    with pytest.raises(PartitaError, match="checkpoint_dir '.*checkpoints' is inside a "
                                           "folder in use by another partita job"):
        check_run_dir(_cfg(tmp_path / "other", f"--train.checkpoint_dir={out}/checkpoints"))
    held.close()
    check_run_dir(_cfg(tmp_path / "other", f"--train.checkpoint_dir={out}/checkpoints"))


def test_a_job_holds_its_folders_and_a_refused_job_leaves_none(tmp_path):
    cfg = _cfg(tmp_path / "run", f"--train.checkpoint_dir={tmp_path / 'ckpt'}")
    locks = prepare_run_dir(cfg)
    assert len(locks) == 2  # out_dir and the checkpoint folder set apart from it
    with pytest.raises(PartitaError, match="train.checkpoint_dir '.*ckpt' is in use"):
        check_not_in_use(tmp_path / "ckpt", "train.checkpoint_dir")
    for handle in locks:
        handle.close()
    # The default checkpoint folder is covered by out_dir's lock: none in it, so a run
    # that saved nothing can still remove it.
    locks = prepare_run_dir(_cfg(tmp_path / "plain"))
    assert len(locks) == 1 and not (tmp_path / "plain" / "checkpoints" / LOCK_FILE).exists()


HOLD = """
import sys, time
from partita.folder_lock import lock_folder
handle = lock_folder(sys.argv[1], "train.out_dir")
print("held", flush=True)
time.sleep(120)
"""


def test_the_lock_goes_with_a_killed_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(PartitaError, match=f"pid {holder.pid} on "):
            check_not_in_use(tmp_path, "train.out_dir")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    deadline = time.monotonic() + 10
    while True:  # the kernel drops the lock as the process goes
        try:
            check_not_in_use(tmp_path, "train.out_dir")
            break
        except PartitaError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    lock_folder(tmp_path, "train.out_dir").close()
