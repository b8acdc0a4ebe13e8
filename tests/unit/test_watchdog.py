"""The stall watch of `partita.watchdog.Progress`, on a clock the test moves; the one-write
lines the ranks print; and a finished rank's wait for the others, which ends a silent or
hung one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

from partita import errors, watchdog
from partita.errors import print_line
from partita.watchdog import Progress, stall_report


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: now[0])
    return now


def _steps(progress: Progress, clock: list[float], first: int, last: int,
           seconds: float = 0.1) -> None:
    for step in range(first, last + 1):
        progress.enter(step, "forward and backward")
        clock[0] += seconds
        progress.enter(step, "optimizer step")


def test_an_evaluation_is_timed_against_evaluations_not_steps(clock) -> None:
    # One process: no store, no thread; the checks are called directly.
    progress = Progress(0, 1, factor=20, min_seconds=2.0, timeout_s=600)
    _steps(progress, clock, 1, 4)
    # The first evaluation compiles its graphs: 25 times a training step, not a stall.
    progress.enter(4, "evaluation")
    clock[0] += 2.5
    assert not progress._stalled()
    _steps(progress, clock, 5, 8)
    progress.enter(8, "evaluation")
    clock[0] += 3.0
    assert not progress._stalled()  # against the 2.5 s evaluation before it
    clock[0] += 47.0
    assert progress._stalled()  # 50 s: 20 times it
    _steps(progress, clock, 9, 9)
    # A training step is still judged against training steps alone, evaluations left out.
    progress.enter(10, "forward and backward")
    clock[0] += 1.9
    assert not progress._stalled()
    clock[0] += 0.2
    assert progress._stalled()
    assert list(progress.durations["evaluation"]) == [2.5, 50.0]
    assert max(progress.durations[watchdog.STEP]) == pytest.approx(0.1)


def test_the_warning_names_the_part_that_stalled() -> None:
    step = stall_report(4, 12.0, 0.3, "", 600)
    assert step.startswith("partita: warning: step 4 has run 12.0 s, 40x the median step time")
    evaluation = stall_report(8, 60.0, 2.5, "rank 1 (step 8, evaluation) behind the others",
                              600, "evaluation")
    assert evaluation.startswith("partita: warning: the evaluation of step 8 has run 60.0 s, "
                                 "24x the median evaluation time (2.50 s); rank 1")


def test_a_message_and_its_newline_leave_in_one_write(monkeypatch) -> None:
    # Ranks share the terminal; print() would write the text and the newline apart, and
    # another rank's line could land between them.
    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(errors.sys, "stderr", Recorder())
    print_line("partita: error (rank 1): the file is corrupt")
    assert writes == ["partita: error (rank 1): the file is corrupt\n"]


# The tail: a finished rank waits for the others -----------------------------------------
@pytest.fixture
def store_of_a_job(monkeypatch):
    """A job's store on a free port, found through MASTER_ADDR and MASTER_PORT."""
    import datetime

    import torch.distributed as dist

    from partita.testing import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    yield store
    del store


@pytest.fixture
def two_ranks(store_of_a_job):
    """Ranks 0 and 1 of a job as two Progress objects of this process, over a real store."""
    ranks = [Progress(r, 2, factor=0, min_seconds=2.0, timeout_s=1.0) for r in (0, 1)]
    for r in (0, 1):  # both are this process: one found silent must not end the test
        ranks[0]._store.set(Progress.PID_KEY.format(rank=r), "another-host|1")
    yield ranks
    for progress in ranks:
        progress.close()


def _waiting(progress: Progress):
    """progress.wait_for_the_others() in a thread; what it raised, once joined."""
    import threading

    raised: list[BaseException] = []

    def wait() -> None:
        try:
            progress.wait_for_the_others(poll_s=0.05)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, raised


def test_a_finished_rank_waits_for_a_working_one_and_then_leaves(two_ranks) -> None:
    working, finished = two_ranks
    working.enter(3, "export")
    thread, raised = _waiting(finished)
    # Twice the timeout: a rank whose work moves (this thread's) is waited for.
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        sum(range(10_000))
    assert thread.is_alive() and not raised
    working.wait_for_the_others(poll_s=0.05)  # rank 1 is done: returns at once
    thread.join(timeout=5)
    assert not thread.is_alive() and not raised


def test_a_rank_silent_at_the_end_is_named_and_ended(two_ranks) -> None:
    stopped, finished = two_ranks
    stopped.enter(3, "export")
    stopped.close()  # its heartbeat stops, as a SIGSTOP stops it
    # The silent rank on this machine is killed: stand in a child process for it.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    finished._store.set(Progress.PID_KEY.format(rank=0),
                        f"{watchdog.socket.gethostname()}|{child.pid}")
    told = _told_at_the_end(finished)
    assert told.startswith(
        "process 1 finished, then waited for the others: rank 0 (last seen in step 3, "
        "export) stopped responding")
    assert "train.collective_timeout_s=1 s, so the job stops" in told
    assert child.wait(timeout=5) == -9


# Rank 0 in a process of its own: its heartbeat beats on while its main thread is blocked
# for good in a read, as in a deadlock or on a disk that does not answer.
HUNG_RANK = """
import os
from partita.watchdog import Progress
progress = Progress(0, {world}, factor=0, min_seconds=2.0, timeout_s=1.0)
progress.enter(3, "export")
print("ready", flush=True)
never_read, _open = os.pipe()
os.read(never_read, 1)
"""


@contextlib.contextmanager
def _hung_rank(world: int):
    """Rank 0 of a job of `world` in a process of its own, hung once it said so; killed
    after the block."""
    hung = subprocess.Popen([sys.executable, "-c", HUNG_RANK.format(world=world)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    try:
        assert hung.stdout.readline() == "ready\n"
        yield hung
    finally:
        hung.kill()
        hung.wait()


def _told_at_the_end(finished: Progress) -> str:
    """What a finished rank's wait for the others raised, within a bound."""
    start = time.monotonic()
    with pytest.raises(watchdog.SilentAtTheEnd) as told:
        finished.wait_for_the_others(poll_s=0.05)
    assert time.monotonic() - start < 10
    return str(told.value)


def test_a_rank_hung_at_the_end_is_named_and_ended(store_of_a_job) -> None:
    finished = Progress(1, 2, factor=0, min_seconds=2.0, timeout_s=1.0)
    with _hung_rank(2) as hung:
        told = _told_at_the_end(finished)
        assert told.startswith(
            "process 1 finished, then waited for the others: rank 0 (last seen in step 3, "
            "export) made no progress (its heartbeat ran on, but its own threads used no "
            "CPU time and read or wrote nothing")
        assert hung.wait(timeout=5) == -9  # on this machine: ended
    finished.close()


def test_a_silent_rank_is_named_alone_beside_one_doing_nothing(store_of_a_job) -> None:
    """Rank 0 doing nothing may be waiting for rank 1, which stopped responding."""
    silent = Progress(1, 3, factor=0, min_seconds=2.0, timeout_s=1.0)
    finished = Progress(2, 3, factor=0, min_seconds=2.0, timeout_s=1.0)
    silent._store.set(Progress.PID_KEY.format(rank=1), "another-host|1")
    with _hung_rank(3) as hung:
        silent.enter(3, "weight write")
        silent.close()
        told = _told_at_the_end(finished)
        assert ": rank 1 (last seen in step 3, weight write) stopped responding" in told
        assert "rank 0" not in told
        assert hung.poll() is None  # not ended: it may have been waiting for rank 1
    finished.close()


def test_a_rank_hung_on_another_machine_ends_itself(store_of_a_job) -> None:
    """A process on another machine cannot be killed from here: the finished rank asks
    through the store, and the hung rank's heartbeat, which still runs, ends it."""
    finished = Progress(1, 2, factor=0, min_seconds=2.0, timeout_s=1.0)
    with _hung_rank(2) as hung:
        finished._store.set(Progress.PID_KEY.format(rank=0), "another-host|1")
        told = _told_at_the_end(finished)
        assert "rank 0 (last seen in step 3, export) made no progress" in told
        assert hung.wait(timeout=10) == -9
        assert hung.stderr.read().strip() == (
            "partita: process 0 made no progress for train.collective_timeout_s=1 s after "
            "process 1 had finished (in step 3, export), so it ends itself.")
    finished.close()


def test_under_partitas_launcher_a_finished_rank_watches_other_machines_only(
        store_of_a_job) -> None:
    """partita's launcher watches the workers of its own node; a finished worker waits
    for, and names, only those of other nodes (a job of one process per node)."""
    local, remote, finished = (Progress(r, 3, factor=0, min_seconds=2.0, timeout_s=1.0)
                               for r in range(3))
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    local._store.set(Progress.PID_KEY.format(rank=0),
                     f"{watchdog.socket.gethostname()}|{stand_in.pid}")
    local.close()  # silent, but the launcher's to judge
    local._store.set(Progress.PID_KEY.format(rank=1), "another-host|1")
    remote.enter(3, "export")
    remote.close()
    try:
        start = time.monotonic()
        with pytest.raises(watchdog.SilentAtTheEnd) as told:
            finished.wait_for_the_others(poll_s=0.05, other_hosts_only=True)
        assert time.monotonic() - start < 10
        assert ": rank 1 (last seen in step 3, export) stopped responding" in str(told.value)
        assert "rank 0" not in str(told.value)
        assert stand_in.poll() is None
        remote._store.set(Progress.DONE_KEY.format(rank=1), "1")
        finished.wait_for_the_others(poll_s=0.05, other_hosts_only=True)  # returns
    finally:
        finished.close()
        stand_in.kill()
        stand_in.wait()
