"""The bounded wait of the shared-memory transports (`shm_share.wait_while`): it returns
once the word changes, gives up after its timeout, and at once when the awaited process
has ended."""

from __future__ import annotations

import ctypes
import subprocess
import threading
import time

import pytest

from partita import shm_os, shm_share

pytestmark = pytest.mark.skipif(not shm_share.supported(), reason="futex: Linux x86-64")


def test_the_wait_returns_when_another_thread_changes_the_word() -> None:
    word = ctypes.c_uint32(7)
    addr = ctypes.addressof(word)

    def change() -> None:
        time.sleep(0.2)
        word.value = 8
        shm_os.futex_wake(addr)

    threading.Thread(target=change).start()
    start = time.monotonic()
    shm_share.wait_while(addr, 7, 10.0, None, "test wait", "the other thread")
    assert word.value == 8 and time.monotonic() - start < 5


def test_the_wait_gives_up_after_its_timeout_naming_who_is_late() -> None:
    word = ctypes.c_uint32(3)
    start = time.monotonic()
    with pytest.raises(shm_share.ShmTimeout, match="pipeline receive timed out: rank 1 "
                                                   "did not arrive within 0.3 s"):
        shm_share.wait_while(ctypes.addressof(word), 3, 0.3, None, "pipeline receive",
                             "rank 1")
    assert 0.25 < time.monotonic() - start < 5


def test_the_wait_ends_when_the_awaited_process_has_ended() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    peer = (proc.pid, shm_os.identity(proc.pid)[0])
    proc.kill()
    proc.wait()
    word = ctypes.c_uint32(0)
    start = time.monotonic()
    with pytest.raises(shm_share.ShmTimeout, match="the process of rank 0 has ended"):
        shm_share.wait_while(ctypes.addressof(word), 0, 60.0, peer, "pipeline send",
                             "rank 0")
    assert time.monotonic() - start < 5


def test_a_failed_setup_leaves_no_file_in_dev_shm(monkeypatch) -> None:
    """The member that makes the file unlinks it even when a collective of the setup
    fails (a member died): a file left in /dev/shm holds its memory until a reboot."""
    import os

    def broken(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(shm_share.dist, "broadcast", broken)
    mine = f"partita-{os.getpid()}-"
    with pytest.raises(RuntimeError, match="Connection closed"):
        shm_share.share(None, [0, 1], 0, 1 << 20, "test transfers")
    assert not [f for f in os.listdir(shm_share.SHM_DIR) if f.startswith(mine)]


def test_files_left_by_a_killed_maker_are_swept_when_the_next_is_made(tmp_path,
                                                                      monkeypatch) -> None:
    """A maker killed between making its file and unlinking it leaves the file (and its
    memory) behind; the next setup on the machine removes it once it is older than
    STALE_S, and never a file whose maker runs or one still young."""
    import os

    monkeypatch.setattr(shm_share, "SHM_DIR", str(tmp_path))
    proc = subprocess.Popen(["true"])
    proc.wait()  # a pid that has ended
    old = time.time() - shm_share.STALE_S - 60
    files = {"dead_old": f"partita-{proc.pid}-{'a' * 16}",
             "dead_young": f"partita-{proc.pid}-{'b' * 16}",
             "alive_old": f"partita-{os.getpid()}-{'c' * 16}",
             "other_name": f"other-{proc.pid}-{'d' * 16}"}
    for key, name in files.items():
        (tmp_path / name).write_bytes(b"x")
        if key != "dead_young":
            os.utime(tmp_path / name, (old, old))
    path, fd = shm_share._create(4096, b"t" * 16)
    os.close(fd)
    os.unlink(path)
    left = set(os.listdir(tmp_path))
    assert files["dead_old"] not in left
    assert {files["dead_young"], files["alive_old"], files["other_name"]} <= left


def test_the_launcher_removes_the_files_its_ended_workers_left(tmp_path, monkeypatch) -> None:
    """Once a job's workers have ended, the launcher removes the /dev/shm files they
    made and did not unlink (a kill during a setup), at once and whatever their age;
    another process's files stay."""
    import os

    from partita.launch import release_shared_memory

    shm = tmp_path / "shm"
    markers = tmp_path / "workers"
    shm.mkdir()
    markers.mkdir()
    monkeypatch.setattr(shm_share, "SHM_DIR", str(shm))
    proc = subprocess.Popen(["true"])
    proc.wait()
    (markers / f"{proc.pid}.started").write_text("1")
    (markers / f"{proc.pid}.finished").write_text("")
    left = shm / f"partita-{proc.pid}-{'e' * 16}"
    other = shm / f"partita-{os.getpid()}-{'f' * 16}"  # a running process's
    stranger = shm / f"partita-{proc.pid + 1}-{'0' * 16}"  # not a worker of this job
    for f in (left, other, stranger):
        f.write_bytes(b"x")
    assert release_shared_memory(str(markers)) == [left.name]
    assert sorted(os.listdir(shm)) == sorted([other.name, stranger.name])
