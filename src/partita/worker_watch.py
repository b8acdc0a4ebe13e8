"""The launcher's watch over a job's last workers.

While every process of a job runs, a stopped or hung one is found by the others: their
next collective times out and they name it (`watchdog`). Once some have finished, the
ones left (process 0 exporting the weights, say) have no peer waiting on them, and
torch's agent waits for them without a bound. This thread, in partita's launcher, ends
a worker that, for the job's collective timeout after another worker of the same start
has finished, stays stopped (SIGSTOP, state T in /proc; not a debugger's stop) or does
nothing (`proc_stat.activity` unchanged: hung in native code, on a lock, on a disk that
does not answer).

A finished worker does not exit (torch's agent keeps it until the whole group is
done), so the workers leave markers in a folder the launcher gives them: one when they
start, with their rank (`mark_started`), one when they finish (`mark_finished`). Linux
only (it reads /proc); elsewhere it sees no states
and does nothing. A whole job suspended with Ctrl-Z stops the launcher too: the watch
restarts its clocks when its own samples show such a gap, so a resumed job is not taken
for a stopped worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from partita.errors import print_line
from partita.proc_stat import activity, process_state

SAMPLE_S = 0.25


def mark_started(folder: str) -> None:
    """Called by a worker as it starts: its pid and rank, for the watch."""
    _mark(folder, f"{os.getpid()}.started", os.environ.get("RANK", "?"))


def mark_finished(folder: str) -> None:
    """Called by a worker whose work is done: the sign that the job's tail has begun."""
    _mark(folder, f"{os.getpid()}.finished", "")


# A worker that stopped with an error it diagnosed itself (a PartitaError: a NaN loss, a
# refused setting, a bad checkpoint) leaves this marker: a restart would resume from the
# same checkpoint with the same data and fail the same way, so the restarted workers
# leave at once (`launch._run_reporting_errors`) and the launcher says why.
REPEATS = "failure-would-repeat"


def mark_failure_would_repeat(folder: str) -> None:
    _mark(folder, REPEATS, os.environ.get("RANK", "?"))


def failure_would_repeat(folder: str) -> bool:
    return bool(folder) and os.path.exists(os.path.join(folder, REPEATS))


def _mark(folder: str, name: str, text: str) -> None:
    if not folder:  # called outside a launch
        return
    with contextlib.suppress(OSError):  # the watch is a safeguard; never fail for it
        with open(os.path.join(folder, name), "w") as marker:
            marker.write(text)


class TailWatch:
    """Samples the workers' states; `check` ends a worker stopped, or idle, for
    `timeout_s` after another, started before it, has finished. Its line says who and
    why, and the agent then reports the killed worker as the job's first failure."""

    def __init__(self, timeout_s: float, folder: str) -> None:
        self.timeout_s, self.folder = timeout_s, folder
        self.sample = 0  # the number of the current sample
        # pid -> the sample its start, or its finish, was first seen in
        self.first_seen: dict[int, int] = {}
        self.finished: dict[int, int] = {}
        self.stopped_since: dict[int, float] = {}  # pid -> when it was first seen stopped
        # pid -> (its activity, since when unchanged), for workers left in the tail
        self.idle_since: dict[int, tuple[int, float]] = {}
        self.gone: set[int] = set()  # exited and reaped: never looked at again
        self.last = time.monotonic()
        self.ended: list[int] = []

    def check(self, now: float) -> None:
        self.sample += 1
        if now - self.last > 4 * SAMPLE_S:  # this process was stopped itself (Ctrl-Z)
            self.stopped_since.clear()
            self.idle_since.clear()
        self.last = now
        with contextlib.suppress(OSError):
            for name in os.listdir(self.folder):
                pid, _, what = name.partition(".")
                if pid.isdigit() and what in ("started", "finished"):
                    seen = self.first_seen if what == "started" else self.finished
                    seen.setdefault(int(pid), self.sample)
        working = []  # running or waiting (R, S, D): the ones that may be idle
        for pid in self.first_seen.keys() - self.gone:
            state = process_state(pid)
            if state in ("R", "S", "D"):
                working.append(pid)
            if state == "T":
                self.stopped_since.setdefault(pid, now)
            else:  # running, waiting, exited or gone
                self.stopped_since.pop(pid, None)
            if state is None:
                self.gone.add(pid)
        for pid, since in list(self.stopped_since.items()):
            if self._in_tail(pid) and now - since >= self.timeout_s:
                self._end(pid, f"was stopped (SIGSTOP) for {now - since:.0f} s")
        for pid in self.first_seen.keys() - self.finished.keys():
            # A worker doing nothing beside a stopped one may be waiting for it.
            look = pid in working and self._in_tail(pid) and not self.stopped_since
            work = activity(pid) if look else None
            if work is None:  # stopped, a debugger's, exited, not in the tail, or waiting
                self.idle_since.pop(pid, None)
                continue
            if self.idle_since.get(pid, (None,))[0] != work:
                self.idle_since[pid] = (work, now)
            idle_s = now - self.idle_since[pid][1]
            if idle_s >= self.timeout_s:
                self._end(pid, f"made no progress for {idle_s:.0f} s (it ran, but its own "
                               "threads used no CPU time and read or wrote nothing: hung "
                               "in native code, on a lock or on a disk that does not "
                               "answer)")

    def _in_tail(self, pid: int) -> bool:
        """Another worker finished after this one appeared: the same start of the job,
        not a worker of an earlier start (--max-restarts)."""
        return any(at > self.first_seen[pid]
                   for other, at in self.finished.items() if other != pid)

    def _end(self, pid: int, what: str) -> None:
        try:
            with open(os.path.join(self.folder, f"{pid}.started")) as marker:
                rank = marker.read() or "?"
        except OSError:
            rank = "?"
        print_line(
            f"partita: process {rank} (pid {pid}) {what}, the job's collective timeout, "
            "after the other processes had finished: nothing else would have ended the "
            "wait, so it was ended. A file it was writing keeps its temporary name.")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.stopped_since.pop(pid, None)
        self.idle_since.pop(pid, None)
        self.gone.add(pid)
        self.ended.append(pid)


@contextmanager
def watching_the_tail(timeout_s: float, folder: str) -> Iterator[TailWatch | None]:
    """Run a `TailWatch` in a background thread for the block (none when `timeout_s`
    is 0); the workers leave their markers in `folder` (made here)."""
    if timeout_s <= 0:
        yield None
        return
    os.makedirs(folder, exist_ok=True)
    watch, done = TailWatch(timeout_s, folder), threading.Event()

    def loop() -> None:
        while not done.wait(SAMPLE_S):
            watch.check(time.monotonic())

    thread = threading.Thread(target=loop, daemon=True, name="partita-worker-watch")
    thread.start()
    try:
        yield watch
    finally:
        done.set()
        thread.join(timeout=2)
