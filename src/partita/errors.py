"""User-facing errors.

Every mistake a user can make (a bad layout, a missing file, a mismatched checkpoint)
raises `PartitaError` with one paragraph that says what is wrong and how to fix it.
The CLI prints that paragraph without a traceback; anything else is a bug in partita.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager


class PartitaError(Exception):
    """An error caused by input the user can change; the message says how."""


def process_count_option(count: int) -> str:
    """How to start `count` processes: `partita train --nproc`, or, under torchrun
    (which sets RANK and WORLD_SIZE, and where --nproc is ignored), its own options."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return f"torchrun's --nproc-per-node x --nnodes = {count}"
    return f"--nproc {count}"


def print_line(text: str) -> None:
    """`text` and its newline on stderr in one write. The processes of a job share the
    terminal, and print() writes the two apart (stderr writes through), so two ranks'
    messages could run together on one line."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to `name`, or None when nothing is close."""
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return found[0] if found else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """' Did you mean X?' when a close candidate exists, else ''."""
    best = closest(name, candidates)
    return f" Did you mean '{best}'?" if best else ""


def pair_hint(name: str, candidates: Iterable[str]) -> str:
    """For an unreadable NAME=VALUE item: ' Give NAME a value ...' when the name is
    right and the value is missing, else `did_you_mean`."""
    candidates = list(candidates)
    if name in candidates:
        return f" Give '{name}' a value: {name}=VALUE."
    return did_you_mean(name, candidates)


class AgreedError(PartitaError):
    """A PartitaError that every rank raises identically (it follows from values all ranks
    share, such as the all-reduced loss); only rank 0 needs to print it."""


class PeerFailure(PartitaError):
    """This process is healthy but a collective failed because another process stopped,
    died or stalled. Its exit status (PEER_FAILURE_EXIT) lets the launcher tell these
    victims from the process that failed first."""


class PeerReported(PeerFailure):
    """Another process failed at a point every process passes together (reading a
    checkpoint) and reports why; this one stops without repeating the message."""


class OutOfDeviceMemory(PartitaError):
    """This process ran out of its device's memory (torch.OutOfMemoryError, or on a CPU
    the allocator's failure): where, and the device's size in bytes (None where unknown
    or on a CPU). `partita train` adds what the planner expects the layout to hold and
    what would lower it."""

    def __init__(self, message: str, device_bytes: float | None, on_cpu: bool = False
                 ) -> None:
        super().__init__(message)
        self.device_bytes, self.on_cpu = device_bytes, on_cpu


PEER_FAILURE_EXIT = 3


class Stopped(BaseException):
    """The run was asked to stop by a signal (Ctrl-C, or SIGTERM from a scheduler).

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way
    swallows it; `finally` blocks still run, so nothing half-written is left behind.
    The process exits with the shell's convention, 128 + the signal number.
    """

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# Exit status of a run that stopped on request (SIGTERM, train.stop_after) after writing
# a checkpoint: EX_TEMPFAIL, "try again later", which is what resuming does.
CHECKPOINT_STOP_EXIT = 75


def stop_file(run_id: str) -> str:
    """The file `partita train`'s launcher creates on the first SIGTERM it passes on
    (`launch._sigterm_to_workers`), for workers that were not there to receive it: one
    per job, by torch elastic's run id, which the workers know too."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"partita-stop-{run_id}")


class StoppedBeforeStart(Stopped):
    """SIGTERM while a training job was starting: nothing of it was trained or written
    and earlier checkpoints are as they were, so it is a stop on request (exit 75, run
    it again) like one after a checkpoint, not the second SIGTERM's stop at once."""

    def __init__(self) -> None:
        import signal

        super().__init__(signal.SIGTERM)

    @property
    def exit_code(self) -> int:
        return CHECKPOINT_STOP_EXIT


class StopRequest:
    """SIGTERM as a request: finish the step, write a checkpoint, exit (what schedulers
    mean when they send it before pre-empting a job). A second SIGTERM, more than
    REPEAT_S later, stops at once.

    Signal handlers belong to the process, so there is one request per process
    (`STOP_REQUEST`); the trainer installs it and reads `signum` at each step's end.
    """

    # SIGTERMs this close together are one request: a scheduler signals every process
    # of the job and `partita train` also passes its own on to its workers.
    REPEAT_S = 3.0

    def __init__(self) -> None:
        self.signum = 0
        self.at = 0.0
        # Until the run is set up a SIGTERM stops the process at once (`stop_on_signals`):
        # there is no step to finish and nothing of this run to save.
        self.installed = False

    def install(self) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; signals then stay as they are
        import time

        # The launcher's record of a SIGTERM this process may have missed while starting.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        if run_id and os.path.exists(stop_file(run_id)) and not self.signum:
            self.signum, self.at = signal.SIGTERM, time.monotonic()

        def handler(signum, _frame):
            import time

            now = time.monotonic()
            if self.signum and now - self.at > self.REPEAT_S:
                raise Stopped(signum)
            if not self.signum:
                self.signum, self.at = signum, now
        signal.signal(signal.SIGTERM, handler)
        self.installed = True  # after: a SIGTERM before this stopped the start-up


STOP_REQUEST = StopRequest()


def before_stop_request(exc: Stopped) -> bool:
    """Whether `exc` is a SIGTERM that came before this process installed its
    `STOP_REQUEST`, while the job was starting: nothing of it was trained or saved, so
    it is a stop on request (`StoppedBeforeStart`, exit 75) and not a stop at once."""
    import signal

    return exc.signum == signal.SIGTERM and not STOP_REQUEST.installed


def _after_the_first(_signum: int, _frame: object) -> None:
    """SIGINT and SIGTERM once `stop_on_signals` has stopped the process: nothing to do."""


def stop_on_signals() -> None:
    """Turn SIGINT and SIGTERM into `Stopped` in this process (main thread only)."""
    import signal

    def handler(signum, _frame):
        # The first signal stops the process; later ones (Ctrl-C reaches every process
        # of the group, and the launcher forwards its own copy) must not interrupt the
        # exit with a second exception and its traceback. They go to a handler that
        # does nothing, not to SIG_IGN: a signal already received but not yet handled
        # when SIG_IGN is set makes Python raise "OSError: Signal 15 ignored due to race
        # condition" at the next line it runs, wherever that is.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _after_the_first)
        raise Stopped(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then take them as usual.

    For importing torch in a process that turns signals into `Stopped`: an exception
    raised inside that import is not safe. Where numpy is not imported yet, torch's C++
    numpy probe clears whatever error numpy's import raised, so a `Stopped` from there
    vanishes, and the process, which took the signal, ignores the next ones as repeats
    (`tests/unit/test_launch_signals.py` shows it); raised inside torch's C++ bindings, it
    aborts the process (exit -6). So the block guards torch's import twice:

    * the signals are blocked (not ignored) in this thread, so one sent meanwhile waits
      and arrives when the block ends; threads started inside inherit the block;
    * threads that existed before (numpy's BLAS workers) do not block them, and the
      kernel may hand the signal to one of those; Python then runs the handler in the
      main thread all the same, inside the block. So while the block lasts, a Python
      handler only notes the signal, and the handler it stood in for runs after.
    """
    import signal
    import threading

    held = (signal.SIGINT, signal.SIGTERM)
    noted: list[int] = []
    standing_in: dict[int, Callable] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in held:
            handler = signal.getsignal(sig)
            if callable(handler):  # ignored, default and C-level handlers stay as they are
                standing_in[sig] = handler
                signal.signal(sig, lambda signum, _frame: noted.append(signum))
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        for sig, handler in standing_in.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)  # delivers what waited
        for signum in noted:
            standing_in[signum](signum, None)


def require_in_range(flag: str, value: int | None, low: int, high: int, why: str = "") -> None:
    """Raise PartitaError unless low <= value <= high (None means not given: fine).

    For command-line counts: a size beyond `high` is refused at once rather than left to
    run for minutes without a word."""
    if value is not None and not low <= value <= high:
        raise PartitaError(f"{flag} {value} is out of range: use {low} to {high:,}"
                           f"{'; ' + why if why else ''}.")
