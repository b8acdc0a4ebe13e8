"""The launcher's watch ends a worker left stopped, or doing nothing, after the others
finished, and no other: not one whose peers still run, not one still working, not one of
a later start, not a job that was suspended whole."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from partita.proc_stat import process_state
from partita.worker_watch import SAMPLE_S, TailWatch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.fixture
def stopped():
    """A process stopped with SIGSTOP, as a stand-in for a worker."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.send_signal(signal.SIGSTOP)
    for _ in range(200):
        if process_state(proc.pid) == "T":
            break
        subprocess.run(["sleep", "0.01"])
    yield proc
    proc.kill()
    proc.wait()


def _marker(folder, name, text=""):
    (folder / name).write_text(text)


def _run(watch, start, seconds):
    """Samples every SAMPLE_S from `start` for `seconds`; the time after the last."""
    now = start
    while now < start + seconds:
        watch.check(now)
        now += SAMPLE_S
    return now


def test_a_worker_stopped_after_another_finished_is_ended(tmp_path, stopped):
    watch = TailWatch(timeout_s=2.0, folder=str(tmp_path))
    watch.last = 0.0
    _marker(tmp_path, f"{stopped.pid}.started", "0")
    _marker(tmp_path, "999999.started", "1")
    now = _run(watch, 0.0, 1.0)
    _marker(tmp_path, "999999.finished")  # rank 1 is done; rank 0 stays stopped
    now = _run(watch, now, 0.5)
    assert watch.ended == []  # stopped for 1.5 s of the 2 s allowed
    _run(watch, now, 1.0)
    assert watch.ended == [stopped.pid]
    assert stopped.wait(timeout=10) == -signal.SIGKILL


def test_no_worker_is_ended_while_none_has_finished(tmp_path, stopped):
    """Its peers still run: they find it themselves, through their collectives."""
    watch = TailWatch(timeout_s=1.0, folder=str(tmp_path))
    watch.last = 0.0
    _marker(tmp_path, f"{stopped.pid}.started", "0")
    _marker(tmp_path, "999999.started", "1")
    _run(watch, 0.0, 5.0)
    assert watch.ended == []
    assert process_state(stopped.pid) == "T"


def test_a_finish_of_an_earlier_start_does_not_count(tmp_path, stopped):
    """After a restart (--max-restarts), the previous start's markers are still there."""
    watch = TailWatch(timeout_s=1.0, folder=str(tmp_path))
    watch.last = 0.0
    _marker(tmp_path, "999998.started", "1")
    _marker(tmp_path, "999998.finished")
    now = _run(watch, 0.0, 1.0)
    _marker(tmp_path, f"{stopped.pid}.started", "0")
    _run(watch, now, 5.0)
    assert watch.ended == []


def test_a_gap_in_the_watch_own_samples_restarts_the_clock(tmp_path, stopped):
    """Ctrl-Z stops the launcher with its workers; once resumed, a worker not yet
    continued is not one stopped for the whole pause."""
    watch = TailWatch(timeout_s=2.0, folder=str(tmp_path))
    watch.last = 0.0
    _marker(tmp_path, f"{stopped.pid}.started", "0")
    _marker(tmp_path, "999999.started", "1")
    now = _run(watch, 0.0, 0.5)
    _marker(tmp_path, "999999.finished")
    now = _run(watch, now, 0.5)
    watch.check(now + 600.0)  # the launcher itself was stopped for ten minutes
    assert watch.ended == []
    _run(watch, now + 600.0 + SAMPLE_S, 2.5)
    assert watch.ended == [stopped.pid]


@contextmanager
def _child(code: str) -> Iterator[subprocess.Popen]:
    """A stand-in worker running `code` once it has said it is ready; killed after."""
    proc = subprocess.Popen([sys.executable, "-c", f"print('ready', flush=True)\n{code}"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


# Blocked for good in a read, as in a deadlock, while a thread that names itself the
# reporter (the heartbeat) keeps busy: that thread's work is not the worker's progress.
HUNG = """
import os, threading
from partita.proc_stat import REPORTER_THREAD, name_this_thread
def beat():
    name_this_thread(REPORTER_THREAD)
    while True:
        sum(range(10_000))
threading.Thread(target=beat, daemon=True).start()
never_read, _open = os.pipe()
os.read(never_read, 1)
"""
WORKING = "while True:\n    sum(range(10_000))"
# The main thread waits for a thread of partita's that works (the checkpoint writer,
# named as Python 3.14 names threads): the process is working.
WAITING_FOR_OWN_THREAD = """
import threading
from partita.proc_stat import name_this_thread
def write():
    name_this_thread("partita-writer")
    while True:
        sum(range(10_000))
writer = threading.Thread(target=write)
writer.start()
writer.join()
"""


def _run_real(watch, seconds):
    """Samples every SAMPLE_S on the real clock: a worker's activity moves in real time."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        watch.check(time.monotonic())
        time.sleep(SAMPLE_S)


def _tail(tmp_path, timeout_s: float, *pids: int) -> TailWatch:
    """A watch over workers `pids` (ranks 0, 1, ...) and one more that finishes once
    0.5 s of samples have passed: the tail begins then."""
    watch = TailWatch(timeout_s=timeout_s, folder=str(tmp_path))
    for rank, pid in enumerate(pids):
        _marker(tmp_path, f"{pid}.started", str(rank))
    _marker(tmp_path, "999999.started", str(len(pids)))
    _run_real(watch, 0.5)
    _marker(tmp_path, "999999.finished")
    return watch


@pytest.mark.parametrize(("code", "ended"), [(HUNG, True), (WORKING, False),
                                              (WAITING_FOR_OWN_THREAD, False)],
                         ids=["hung", "working", "waiting-for-own-thread"])
def test_a_worker_that_does_nothing_after_another_finished_is_ended(tmp_path, code, ended):
    with _child(code) as proc:
        watch = _tail(tmp_path, 1.0, proc.pid)
        _run_real(watch, 3.0)
        assert watch.ended == ([proc.pid] if ended else [])
        if ended:
            assert proc.wait(timeout=10) == -signal.SIGKILL


def test_a_hung_worker_is_left_alone_while_none_has_finished(tmp_path):
    """Before the tail its peers' collectives find it; and a worker waiting in one is
    idle without being hung."""
    with _child(HUNG) as proc:
        watch = TailWatch(timeout_s=0.5, folder=str(tmp_path))
        _marker(tmp_path, f"{proc.pid}.started", "0")
        _marker(tmp_path, "999999.started", "1")
        _run_real(watch, 2.0)
        assert watch.ended == []
        assert process_state(proc.pid) == "S"


def test_a_stopped_worker_is_ended_before_one_that_may_wait_for_it(tmp_path):
    """A worker doing nothing beside a stopped one may be waiting for it in a
    collective: the stopped one is ended first, and the other judged from then on."""
    with _child(HUNG) as hung, _child(WORKING) as later_stopped:
        watch = _tail(tmp_path, 2.0, hung.pid, later_stopped.pid)
        _run_real(watch, 1.5)
        later_stopped.send_signal(signal.SIGSTOP)
        # Idle for 2.5 s: ended by now, were it not for the stopped one beside it.
        _run_real(watch, 1.0)
        assert watch.ended == []
        # Stopped for 3 s, a margin for a loaded machine; the idle one, judged from the
        # stopped one's end (about 1 s ago), is not yet due.
        _run_real(watch, 2.0)
        assert watch.ended == [later_stopped.pid]
        _run_real(watch, 3.0)  # idle for 3 s or so since the stopped one was ended
        assert watch.ended == [later_stopped.pid, hung.pid]
