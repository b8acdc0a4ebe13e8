"""Where each rank is in its step, whether it is alive, and a warning when it stalls.

Every rank publishes "step, phase" to the job's key-value store (the one
torch.distributed's rendezvous set up) when it enters a phase of a step, and a
background thread bumps a heartbeat counter four times a second. Two uses:

* when a collective fails, the ranks that waited name the ones whose heartbeat stopped
  (stopped, hung or dead) or, failing that, the ones behind the others;
* on rank 0 the thread compares how long the current step has run with the median step
  time; past `factor` times the median (and at least `min_seconds`) it prints once which
  ranks are behind or silent, well before the collective timeout ends the job. The
  phases around the training steps (`OWN_CLOCK`: evaluation, checkpoint and weight
  writes) are timed apart, each against its own earlier lengths: a first evaluation
  that compiles its graphs, or a checkpoint written to a slow disk, is not a stall of
  the step it follows.

A stalled rank cannot report itself, so the report comes from the ones waiting for it.
Once a rank has finished, no collective waits on the ones still working (process 0
exporting the weights, say): where partita's launcher does not watch that tail (under
torchrun or srun, and on the other nodes of a job), a finished rank waits for the
others itself (`wait_for_the_others`) and ends the job when one stays still for the
collective timeout: its heartbeat, or, with the heartbeat running on, its work
(`proc_stat.activity`, which the heartbeat publishes beside each beat; a process hung
in native code beats on but does nothing). Such a process on another machine is asked
through the store to end, and its heartbeat does so.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import statistics
import threading
import time
from collections import deque

from partita.errors import PeerFailure, print_line
from partita.proc_stat import REPORTER_THREAD, activity, name_this_thread

# Phases in the order a step passes them; a rank in an earlier phase is behind.
PHASES = ("setup", "checkpoint load", "forward and backward", "gradient reduction",
          "clipping", "loss average", "optimizer step", "evaluation", "checkpoint wait",
          "checkpoint copy", "checkpoint write", "weight write", "export")
# Phases that are not part of a training step's own work, each timed against itself.
# "checkpoint wait": for the save before this one to finish writing.
OWN_CLOCK = ("checkpoint load", "evaluation", "checkpoint wait", "checkpoint copy",
             "checkpoint write", "weight write", "export")
STEP = "step"  # the part of a step made of the other phases
BEAT_S = 0.25  # heartbeat period
SILENT_S = 1.5  # a heartbeat unchanged this long means the process is not running


def _store_client():
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=5),
                          wait_for_workers=False)
    # A restarted job (--max-restarts) must not read the previous attempt's records.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt-{attempt}", store)


class SilentAtTheEnd(PeerFailure):
    """A finished rank waited for the others and one stopped responding; the message
    names it."""


class Progress:
    """Publishes this rank's position and heartbeat; rank 0 also watches for stalls."""

    STEP_KEY = "partita/progress/{rank}"
    BEAT_KEY = "partita/beat/{rank}"
    PID_KEY = "partita/pid/{rank}"
    DONE_KEY = "partita/done/{rank}"
    # Set for a rank found doing nothing at the end: its heartbeat, which still runs,
    # ends its process wherever it is (another machine's cannot be killed from here).
    END_KEY = "partita/end/{rank}"

    def __init__(self, rank: int, world_size: int, factor: float, min_seconds: float,
                 timeout_s: float) -> None:
        self.rank, self.world = rank, world_size
        self.factor, self.min_seconds, self.timeout_s = factor, min_seconds, timeout_s
        self.enabled = world_size > 1 and "MASTER_ADDR" in os.environ
        self.step, self.phase = 0, "setup"
        # The part now running (STEP or a phase of OWN_CLOCK), since when, and the
        # lengths of the earlier ones of each kind.
        self.part, self.part_started = STEP, time.monotonic()
        self.durations: dict[str, deque[float]] = {}
        self._store = _store_client() if self.enabled else None
        self._stop = threading.Event()
        self._thread = None
        if self.enabled:
            self._store.set(self.PID_KEY.format(rank=rank), f"{socket.gethostname()}|{os.getpid()}")
            # Every key exists before training starts (a read of a missing key waits for
            # it): a rank stopped before its first heartbeat still reads as silent.
            self._store.set(self.BEAT_KEY.format(rank=rank), "0")
            self.enter(0, PHASES[0])
            self._thread = threading.Thread(target=self._background, daemon=True,
                                            name="partita-heartbeat")
            self._thread.start()

    def enter(self, step: int, phase: str) -> None:
        """This rank starts `phase` of `step` (1-based)."""
        part = phase if phase in OWN_CLOCK else STEP
        if step != self.step or part != self.part:
            now = time.monotonic()
            if self.step > 0:
                self.durations.setdefault(self.part, deque(maxlen=50)).append(
                    now - self.part_started)
            self.step, self.part, self.part_started = step, part, now
        self.phase = phase
        if self._store is not None:
            self._store.set(self.STEP_KEY.format(rank=self.rank), f"{step}|{phase}")

    def wait_for_the_others(self, poll_s: float = BEAT_S, other_hosts_only: bool = False
                            ) -> None:
        """This rank's work is done: publish it, then wait until every rank's is (with
        `other_hosts_only`, every rank's on other machines: this one's launcher watches
        its own).

        A rank whose heartbeat stays still for `timeout_s` (stopped, hung or dead), or
        whose heartbeat runs on while its work stays still that long (hung in native
        code, on a lock, on a disk that does not answer), is named, killed if on this
        machine, and SilentAtTheEnd ends this rank, so that the launcher ends the job
        instead of waiting for that rank without a bound. A rank whose work moves (a long
        export) is waited for. A store that is gone means its host, the job's agent or
        rank 0, has ended the job: nothing to wait for.
        """
        if self._store is None:
            return
        try:
            silent, idle = self._still_before_done(poll_s, other_hosts_only)
            if not silent and not idle:
                return
            where = self.positions()
            self._kill_local(silent + idle)
            for r in idle:
                self._store.set(self.END_KEY.format(rank=r), str(self.rank))
        except Exception:  # the store's host ended
            return
        raise SilentAtTheEnd(
            f"process {self.rank} finished, then waited for the others: "
            f"{describe(where, silent, idle)} for train.collective_timeout_s="
            f"{self.timeout_s:g} s, so the job stops. Files it was writing keep their "
            "temporary names; the ones named before it stopped are complete.")

    def _still_before_done(self, poll_s: float, other_hosts_only: bool
                           ) -> tuple[list[int], list[int]]:
        """Mark this rank done and poll the others (or those on other hosts): ([], [])
        once every one is done, else the ones whose heartbeat, and the ones whose work
        (their heartbeat moving), stayed still for `timeout_s` first."""
        self._store.set(self.DONE_KEY.format(rank=self.rank), "1")
        pending = [r for r in range(self.world) if r != self.rank]
        if other_hosts_only and pending:
            here = socket.gethostname()
            hosts = self._store.multi_get([self.PID_KEY.format(rank=r) for r in pending])
            pending = [r for r, host in zip(pending, hosts, strict=True)
                       if host.decode().partition("|")[0] != here]
        beat_clock, work_clock = _StillClock(), _StillClock()
        last_poll = time.monotonic()
        while True:
            pending = [r for r in pending
                       if not self._store.check([self.DONE_KEY.format(rank=r)])]
            if not pending:
                return [], []
            now = time.monotonic()
            if now - last_poll > 5 * poll_s:  # this process was suspended (Ctrl-Z)
                beat_clock.restart()
                work_clock.restart()
            last_poll = now
            latest = self._store.multi_get([self.BEAT_KEY.format(rank=r) for r in pending])
            for r, value in zip(pending, latest, strict=True):
                beat, _, work = value.decode().partition("|")
                beat_clock.see(r, beat, now)
                # No figure (in a step, or no /proc to read it from): taken as moving
                # with the heartbeat, never as idle.
                work_clock.see(r, work or f"beat {beat}", now)
            silent = beat_clock.still(pending, now, self.timeout_s)
            if silent:  # the ones doing nothing beside them may be waiting for them
                return silent, []
            idle = work_clock.still(pending, now, self.timeout_s)
            if idle:
                return [], idle
            time.sleep(poll_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    # What the others are doing -------------------------------------------------------------
    def positions(self, store=None) -> dict[int, tuple[int, str]]:
        """rank -> (step, phase) as last published by every rank."""
        store = store or self._store
        where = {}
        for r in range(self.world):
            step, _, phase = store.get(self.STEP_KEY.format(rank=r)).decode().partition("|")
            where[r] = (int(step), phase)
        return where

    def silent(self, store=None) -> list[int]:
        """Ranks whose heartbeat did not move for SILENT_S seconds (takes that long)."""
        store = store or self._store
        keys = [self.BEAT_KEY.format(rank=r) for r in range(self.world)]
        before = store.multi_get(keys)
        time.sleep(SILENT_S)
        after = store.multi_get(keys)
        return [r for r in range(self.world) if r != self.rank and before[r] == after[r]]

    def culprits(self) -> str:
        """Who to look at after a failed collective: silent ranks first, else the ranks
        behind the furthest one; '' when that cannot be told.

        Silent processes on this machine are then killed: the job is ending, and torch's
        launcher would otherwise wait 30 s for a stopped process to honour its SIGTERM."""
        if self._store is None:
            return ""
        try:
            where = self.positions()
            silent = self.silent()
            self._kill_local(silent)
        except Exception:  # the store's host may be the process that died
            return ""
        return describe(where, silent)

    def _kill_local(self, ranks: list[int]) -> None:
        for r in ranks:
            host, _, pid = self._store.get(self.PID_KEY.format(rank=r)).decode().partition("|")
            if host == socket.gethostname():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    # The background thread -----------------------------------------------------------------
    def _background(self) -> None:
        name_this_thread(REPORTER_THREAD)  # its own work is not the process's progress
        store = _store_client()
        beat, reported = 0, None
        key = self.BEAT_KEY.format(rank=self.rank)
        pid = os.getpid()
        end_key = self.END_KEY.format(rank=self.rank)
        while not self._stop.wait(BEAT_S):
            beat += 1
            try:
                # Only the phases around the steps (OWN_CLOCK: the tail's among them) are
                # ever judged by their work, or asked to end: a step spares reading every
                # thread's /proc and a look at the store.
                judged = self.part != STEP
                work = activity(pid) if judged else None
                store.set(key, f"{beat}|{'' if work is None else work}")
                if judged and beat % 4 == 0 and store.check([end_key]):
                    self._end_this_process(int(store.get(end_key)))
                at = (self.step, self.part)
                if self.rank == 0 and self.factor > 0 and at != reported and self._stalled():
                    reported = at
                    waited = time.monotonic() - self.part_started
                    print_line(stall_report(self.step, waited,
                                            statistics.median(self.durations[self.part]),
                                            describe(self.positions(store), self.silent(store)),
                                            self.timeout_s, self.part))
            except Exception:
                return  # the job is ending; the main thread reports why

    def _end_this_process(self, by: int) -> None:
        """Another rank finished and found this one doing nothing for `timeout_s`: its
        main thread is stuck, so this thread ends the process."""
        print_line(f"partita: process {self.rank} made no progress for "
                   f"train.collective_timeout_s={self.timeout_s:g} s after process {by} had "
                   f"finished (in step {self.step}, {self.phase}), so it ends itself.")
        os.kill(os.getpid(), signal.SIGKILL)

    def _stalled(self) -> bool:
        """The part now running has run `factor` times the median of its kind (and at
        least `min_seconds`). Steps are judged from the third (the first ones may compile
        or warm up), the other parts from their second."""
        history = self.durations.get(self.part, ())
        if len(history) < (2 if self.part == STEP else 1):
            return False
        waited = time.monotonic() - self.part_started
        return waited >= max(self.factor * statistics.median(history), self.min_seconds)


class _StillClock:
    """Since when each rank's value (its heartbeat, or its work) has not changed."""

    def __init__(self) -> None:
        self.values: dict[int, str] = {}
        self.since: dict[int, float] = {}

    def see(self, rank: int, value: str, now: float) -> None:
        if self.values.get(rank) != value:
            self.values[rank], self.since[rank] = value, now
        # After a restart the value is unchanged but its clock starts again.
        self.since.setdefault(rank, now)

    def restart(self) -> None:
        self.since.clear()

    def still(self, ranks: list[int], now: float, timeout_s: float) -> list[int]:
        return [r for r in ranks if now - self.since[r] >= timeout_s]


def describe(where: dict[int, tuple[int, str]], silent: list[int],
             idle: list[int] = ()) -> str:
    """'rank 1 (last seen in step 3, export) stopped responding (...)', '... made no
    progress (...)' or 'rank 1 (step 3, forward and backward) behind the others'."""
    def seen(ranks: list[int]) -> str:
        return ", ".join(f"rank {r} (last seen in step {where[r][0]}, {where[r][1]})"
                         for r in ranks)

    told = []
    if silent:
        told.append(seen(silent) + " stopped responding (stopped, hung or dead; ended now "
                    "if on this machine)")
    if idle:
        told.append(seen(idle) + " made no progress (its heartbeat ran on, but its own "
                    "threads used no CPU time and read or wrote nothing: hung in native "
                    "code, on a lock or on a disk that does not answer; ended now)")
    if told:
        return "; ".join(told)
    late = ranks_behind(where)
    if late:
        return ", ".join(f"rank {r} (step {where[r][0]}, {where[r][1]})"
                         for r in late) + " behind the others"
    return ""


def ranks_behind(where: dict[int, tuple[int, str]]) -> list[int]:
    """Ranks at an earlier (step, phase) than the furthest rank."""
    if not where:
        return []
    order = {phase: i for i, phase in enumerate(PHASES)}
    position = {r: (s, order.get(p, 0)) for r, (s, p) in where.items()}
    furthest = max(position.values())
    return sorted(r for r, pos in position.items() if pos < furthest)


def stall_report(step: int, waited: float, median: float, who: str, timeout_s: float,
                 part: str = STEP) -> str:
    """The warning for a stalled step (or `part` of it, a phase of OWN_CLOCK)."""
    who = who or "every rank is at the same point, so one is stuck inside it"
    what = f"step {step}" if part == STEP else f"the {part} of step {step}"
    return (f"partita: warning: {what} has run {waited:.1f} s, {waited / median:.0f}x the "
            f"median {part} time ({median:.2f} s); {who}. If it does not recover the job "
            f"stops after train.collective_timeout_s={timeout_s:g} s.")
