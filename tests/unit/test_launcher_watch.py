"""A worker tells whether its launcher is alive, and which process that is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from partita.launch import LAUNCHER_PID, LauncherGone, LauncherWatch, launcher_pid


def test_a_worker_whose_launcher_exited_stops_and_a_live_one_goes_on():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # exited and reaped: its pid is free
    watch = LauncherWatch(done.pid, every_s=0.0)
    with pytest.raises(LauncherGone, match=rf"\(pid {done.pid}\) is gone"):
        watch.check()
    LauncherWatch(os.getpid(), every_s=0.0).check()  # alive: nothing happens
    LauncherWatch(None, every_s=0.0).check()  # no launcher to watch


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_an_unreaped_launcher_counts_as_gone():
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while not os.path.exists(f"/proc/{zombie.pid}/stat") or \
            open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        pass  # exited, not yet waited for
    try:
        with pytest.raises(LauncherGone):
            LauncherWatch(zombie.pid, every_s=0.0).check()
    finally:
        zombie.wait()


def test_only_a_launcher_the_worker_depends_on_is_watched(monkeypatch):
    monkeypatch.delenv(LAUNCHER_PID, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert launcher_pid() is None  # srun or a direct call: the parent may leave freely
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert launcher_pid() == os.getppid()  # torchrun's agent
    monkeypatch.setenv(LAUNCHER_PID, "1234")
    assert launcher_pid() == 1234  # partita's launcher, through its fork server
