"""Start N local processes (one node of a possibly multi-node job) with torch's elastic
launcher — the machinery behind `torchrun` — and run a function on each.

Under `torchrun` or Slurm the environment already describes the world (RANK,
WORLD_SIZE, MASTER_ADDR, ...); then partita runs the function directly in the current
process and this module is not used.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass

from partita.errors import (
    CHECKPOINT_STOP_EXIT,
    PEER_FAILURE_EXIT,
    STOP_REQUEST,
    PartitaError,
    Stopped,
    StoppedBeforeStart,
    before_stop_request,
    print_line,
    stop_file,
    stop_on_signals,
)
from partita.local_world import (
    SERVER_IGNORES,
    hangup_ignored,
    start_fork_server,
    stop_fork_server,
    worker_signal_defaults,
)
from partita.proc_stat import pid_alive
from partita.worker_watch import (
    failure_would_repeat,
    mark_failure_would_repeat,
    mark_finished,
    mark_started,
    watching_the_tail,
)

SHUTDOWN_TIMEOUT_S = 5


@dataclass(frozen=True)
class LaunchSpec:
    nproc: int = 1  # processes on this node
    nnodes: int = 1
    rdzv_endpoint: str = ""  # host:port every node can reach; "" = this machine, free port
    rdzv_id: str = ""  # shared by the nodes of one job; "" = a fresh id (single node)
    max_restarts: int = 0
    # How long the nodes of a multi-node job wait for each other before the job stops
    # with a message (torch's own default is 10 minutes of silence).
    join_timeout_s: float = 120.0
    # SIGTERM to this process is passed on to the workers, which finish their step,
    # write a checkpoint and return (partita train); a second SIGTERM stops at once.
    # Otherwise torch's agent stops the workers itself (SIGTERM, then SIGKILL).
    forward_sigterm: bool = False
    # Modules every worker imports, imported once by the fork server the workers start
    # from (`start_worker_server`).
    preload: tuple[str, ...] = ()
    # Once some workers have finished, one left stopped, or doing nothing, this long is
    # ended (`worker_watch`); 0: never. `partita train` gives its collective timeout.
    tail_timeout_s: float = 0.0


LAUNCHER_PID = "PARTITA_LAUNCHER_PID"


def launcher_pid() -> int | None:
    """The process this worker cannot go on without: partita's launcher, or torchrun's
    agent (its parent); None when neither started it (Slurm's srun, a direct call)."""
    if os.environ.get(LAUNCHER_PID):
        return int(os.environ[LAUNCHER_PID])
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


# The folder of the markers a worker of partita's launcher leaves (`worker_watch`).
WORKER_MARKERS = "PARTITA_WORKER_MARKERS"


def mark_this_worker_finished() -> bool:
    """Under partita's launcher, tell its watch that this worker's work is done, before
    the worker waits for the others (`Progress.wait_for_the_others`); False elsewhere."""
    folder = os.environ.get(WORKER_MARKERS, "")
    if folder:
        mark_finished(folder)
    return bool(folder)


class LauncherGone(PartitaError):
    def __init__(self, pid: int) -> None:
        super().__init__("this process stopped rather than train on unattended: "
                         f"{self.sentence(pid, start='the')}.")

    @staticmethod
    def sentence(pid: int, start: str = "The") -> str:
        return (f"{start} launcher that started this process (pid {pid}) is gone, killed or "
                "crashed, and the job cannot go on without it: start the job again with "
                "--train.resume=auto to continue from its newest checkpoint")


class LauncherWatch:
    """Stops a worker whose launcher has died (`kill -9`, the out-of-memory killer).
    Jobs whose ranks talk through the launcher's store notice its loss in their next
    collective; a one-process job would otherwise train on, orphaned, to its end."""

    def __init__(self, pid: int | None, every_s: float = 1.0) -> None:
        self.pid, self.every_s = pid, every_s
        self._next = time.monotonic() + every_s

    def check(self) -> None:
        """Raise LauncherGone if the launcher has exited (looked at once per every_s)."""
        if self.pid is None or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.every_s
        if not pid_alive(self.pid):
            raise LauncherGone(self.pid)


def process_gone(pid: int, wait_s: float = 1.0) -> bool:
    """Whether process `pid` has exited, allowing it `wait_s`: a worker's collectives
    fail as soon as a killed launcher's store closes, a moment before it is reaped."""
    deadline = time.monotonic() + wait_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


TRACKER_QUIET = "ignore:resource_tracker:UserWarning"
# The process that started the fork server (forked children start their own).
_server_started_by: int | None = None


def quiet_torch_native_warnings() -> None:
    """Keep torch's C++ log to errors in the processes that import torch from here on.

    torch's C++ warnings carry a native stack trace each: when a job ends badly (its
    launcher killed, a peer gone) every worker printed dozens of frames around the one
    line partita prints about it. torch reads the level once, as it is imported, and the
    workers share the launcher's import (`start_worker_server`), so the launcher sets it
    before its own. PARTITA_DEBUG=1 or the user's own TORCH_CPP_LOG_LEVEL keeps
    everything."""
    if os.environ.get("PARTITA_DEBUG") != "1":
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def start_worker_server(preload: tuple[str, ...]) -> None:
    """Start the fork server that `launch` makes its workers from, importing `preload`.

    Workers forked from a server that has imported torch once start in a fraction of a
    second, where spawned ones import torch each (about 3 s apiece on a 2-core machine,
    all at once). The server is itself a fork of the launcher, which imports torch for
    the agent anyway: called once torch is imported and before anything runs with it,
    one import serves both; the server's remaining imports (partita's) run beside the
    launcher's own checks. The server never runs torch code itself, so forking it is as
    safe as a spawn: no threads, no CUDA context. Calling it again changes nothing.
    """
    import multiprocessing
    global _server_started_by
    if _server_started_by == os.getpid():
        # Started already (`partita train` starts it before its checks, `launch` asks
        # again): no second moment of ignoring SIGTERM. By then torch's threads exist,
        # and one that does not block the signal would take it while it is ignored: a
        # SIGTERM in that moment was lost and the job trained on.
        return
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    # The server ignores SIGINT, SIGTERM and SIGHUP (`start_fork_server` says why; a
    # SIGTERM sent while it starts used to be lost, and the job trained on); each worker
    # restores them (`_run_reporting_errors`).
    environ = dict(os.environ)
    os.environ[LAUNCHER_PID] = str(os.getpid())  # so a worker can tell it is orphaned
    # The standard library's resource tracker starts here too. When the launcher is
    # killed it unlinks the semaphores torch's agent made for the workers, and says
    # "There appear to be N leaked semaphore objects" under partita's own line about
    # the launcher: nothing the user must act on.
    os.environ["PYTHONWARNINGS"] = ",".join(
        x for x in (os.environ.get("PYTHONWARNINGS"), TRACKER_QUIET) if x)
    try:
        start_fork_server(fork_this_process=True)  # it inherits this environment
        _server_started_by = os.getpid()
    finally:
        os.environ.clear()
        os.environ.update(environ)


def stop_worker_server() -> None:
    """Stop the fork server at once, once its workers have exited or the job was refused
    before launch (`local_world.stop_fork_server`): left alone, it holds this process's
    stdout and stderr open for 1-4 s after it, for whatever reads them to the end (a
    pipe, `tee`)."""
    global _server_started_by
    _server_started_by = None  # a later launch starts a new one
    stop_fork_server()


def launched_externally() -> bool:
    """True under torchrun / Slurm-with-torchrun / our own launcher's children."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(spec: LaunchSpec, fn: Callable, *args) -> list:
    """Run fn(*args) on spec.nproc local processes; return their results by local rank."""
    # torch's agent keeps each worker's error file in a log folder, by default a fresh
    # one under /tmp that nobody removes: one per job. Ours goes once the job is over.
    with tempfile.TemporaryDirectory(prefix="partita-launch-",
                                     ignore_cleanup_errors=True) as log_dir:
        return _launch(spec, log_dir, fn, *args)


def _launch(spec: LaunchSpec, log_dir: str, fn: Callable, *args) -> list:
    running = ExitStack()
    with _stops_before_start():  # up to the moment SIGTERM is passed on to the workers
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous.api import (
            RendezvousError,
            RendezvousTimeoutError,
        )
        from torch.distributed.launcher.api import elastic_launch

        config, forward_sigterm = _launch_config(spec, log_dir)
        running.enter_context(_sigterm_to_workers(forward_sigterm, stop_file(config.run_id)))
    try:
        # SIGTERM is passed on while the workers run
        markers = os.path.join(log_dir, "workers")
        os.makedirs(markers, exist_ok=True)
        with running, watching_the_tail(spec.tail_timeout_s, markers):
            try:
                results = elastic_launch(config, _run_reporting_errors)(markers, fn, *args)
            finally:
                release_shared_memory(markers)
    except RendezvousTimeoutError:
        others = _nodes_waiting(config.rdzv_endpoint, config.run_id)
        count = (f" (at least {others + 1} of {spec.nnodes} had joined)" if others is not None
                 else "")
        raise PartitaError(
            f"the job's {spec.nnodes} nodes did not all join the rendezvous at "
            f"{config.rdzv_endpoint} within {spec.join_timeout_s:g} s{count}, so nothing was "
            "started. Start the same command on every node with the same --rdzv-id and "
            "--rdzv-endpoint (an address every node can reach), check --nnodes, or give "
            "slow nodes longer with --rdzv-timeout SECONDS."
        ) from None
    except RendezvousError as exc:  # the host node's store went away, or refused us
        raise PartitaError(
            f"the rendezvous at {config.rdzv_endpoint} failed ({type(exc).__name__}): the "
            "node hosting it gave up, died or is unreachable. Start every node of the job "
            "again with the same --rdzv-id and --rdzv-endpoint."
        ) from None
    except SignalException as exc:
        # The agent caught SIGINT/SIGTERM and has already stopped the workers.
        raise Stopped(int(exc.sigval)) from None
    except ChildFailedError as exc:
        rank, failure = _first_cause(exc.failures)
        if failure.exitcode == CHECKPOINT_STOP_EXIT:  # a worker's SIGTERM while starting
            raise StoppedBeforeStart() from None
        if failure.exitcode in (128 + signal.SIGINT, 128 + signal.SIGTERM):
            raise Stopped(failure.exitcode - 128) from None
        if failure.exitcode < 0:  # killed by a signal nobody handled
            how = f"was killed by {signal.Signals(-failure.exitcode).name}"
            said = ("it printed nothing: a kill, the out-of-memory killer, a crash in "
                    "native code, or partita's own peers ending it after it stopped "
                    "responding (then the messages above say so)")
        elif failure.exitcode == PEER_FAILURE_EXIT:  # every failure was a victim's
            how = "timed out waiting for another process"
            said = "the messages above name the process that was behind, where one could tell"
        else:
            how, said = f"stopped with exit code {failure.exitcode}", "its message is above"
        kept = ""
        if spec.max_restarts and failure_would_repeat(markers):
            kept = (" It was not restarted (--max-restarts): a restart resumes from the "
                    "same checkpoint with the same data, so the error would repeat.")
        raise PartitaError(
            f"process {rank} of the job {how}, the first to fail; {said}. The other "
            f"processes were stopped.{kept}"
        ) from None
    return [results[r] for r in sorted(results)]


def release_shared_memory(markers: str) -> list[str]:
    """Every worker of the job has ended here. One killed (SIGKILL, the out-of-memory
    killer) while it set up a shared-memory transport leaves that file in /dev/shm, and
    its memory with it: remove the workers' files now, rather than at the next job's
    sweep (`shm_share.sweep_stale`). The names removed."""
    from partita import shm_share  # imports torch: not before a launch

    pids = [int(pid) for pid, _, what in (n.partition(".") for n in os.listdir(markers))
            if what == "started" and pid.isdigit()]
    return shm_share.remove_left_by(pids)


def _launch_config(spec: LaunchSpec, log_dir: str):
    """The elastic agent's configuration for `spec` (and whether SIGTERM is passed on
    to the workers), with the worker server started."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    from partita.local_world import free_port

    if spec.nnodes > 1 and not (spec.rdzv_endpoint and spec.rdzv_id):
        raise PartitaError(
            f"--nnodes {spec.nnodes} needs --rdzv-endpoint HOST:PORT (an address of one "
            "node that every node can reach) and the same --rdzv-id on every node."
        )
    start_worker_server(spec.preload)  # unless the caller has started it already
    extra = {}
    # After one process fails, the others get this long to exit on SIGTERM before
    # SIGKILL (torch waits 30 s, which a SIGSTOPped process always uses up). Older
    # torch releases (2.11 and before) have no such field and keep their 30 s.
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:
        extra["shutdown_timeout"] = SHUTDOWN_TIMEOUT_S
    if spec.forward_sigterm and "signals_to_handle" in LaunchConfig.__dataclass_fields__:
        # SIGTERM is ours; SIGHUP stays ignored in a job started under nohup.
        extra["signals_to_handle"] = ("SIGINT,SIGQUIT" if hangup_ignored()
                                      else "SIGINT,SIGHUP,SIGQUIT")
    config = LaunchConfig(
        min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc,
        run_id=spec.rdzv_id or uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint=spec.rdzv_endpoint or f"127.0.0.1:{free_port()}",
        # join_timeout is the key torch's c10d rendezvous reads for its overall wait.
        rdzv_configs={"join_timeout": int(math.ceil(spec.join_timeout_s))},
        max_restarts=spec.max_restarts, monitor_interval=0.2, start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        **extra,
    )
    # The agent logs each failed child with a long record; the child has already printed
    # its own message (a one-paragraph PartitaError or a traceback), which is the one
    # worth reading, so keep the agent to critical messages. torch's elastic modules set
    # their own loggers' levels (`get_logger`), so each one is quietened, not only the
    # parent: else Ctrl-C still prints the agent's "Received 2 death signal" line.
    quiet = ("torch.distributed.elastic", "torch.multiprocessing")
    for name in [*quiet, *logging.Logger.manager.loggerDict]:
        if name.startswith(quiet):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    return config, spec.forward_sigterm and bool(extra)


@contextmanager
def _stops_before_start():
    """Until `_sigterm_to_workers` takes SIGTERM over, the command line's handler turns
    one into `Stopped` wherever this process is (importing torch's elastic agent takes
    a few tenths of a second). No worker exists yet, so it is a stop before the start
    (exit 75), not the second SIGTERM's stop at once (143) that a `Stopped` from a
    running launch means."""
    try:
        yield
    except Stopped as exc:
        if exc.signum != signal.SIGTERM or isinstance(exc, StoppedBeforeStart):
            raise
        raise StoppedBeforeStart() from None


@contextmanager
def _sigterm_to_workers(enabled: bool, request_file: str):
    """While the workers run, pass a SIGTERM on to them instead of stopping them; a
    second one stops everything at once (`Stopped`).

    A worker not started yet, or one still ignoring SIGTERM as the fork server it comes
    from does, misses the signal, and the run trained on to its end as if never asked
    to stop (a SIGTERM 2.6-2.9 s after starting a 2-process run on this project's
    machine). So the request is also left as `request_file` (`errors.stop_file`), which
    `StopRequest.install` reads; it goes when the job ends."""
    if not enabled:
        yield
        return
    import multiprocessing

    seen = []

    def handler(signum, _frame):
        import time

        if seen and time.monotonic() - seen[0] > STOP_REQUEST.REPEAT_S:
            raise Stopped(signum)
        if seen:
            return
        seen.append(time.monotonic())
        with open(request_file, "w"):
            pass
        for child in multiprocessing.active_children():  # the workers
            os.kill(child.pid, signal.SIGTERM)

    with suppress(FileNotFoundError):  # a request of an earlier job of this run id
        os.remove(request_file)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        with suppress(FileNotFoundError):
            os.remove(request_file)


def _nodes_waiting(endpoint: str, run_id: str) -> int | None:
    """Other nodes still in the rendezvous after this one gave up, read from its store;
    None when that cannot be told (the store's host is gone, or torch keeps the state
    differently). A node that timed out earlier has left it, hence 'at least'."""
    import datetime
    import pickle

    try:
        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )

        host, _, port = endpoint.rpartition(":")
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=2))
        got = C10dRendezvousBackend(store, run_id).get_state()
        # torch's own record of the rendezvous, written by the nodes of this job
        state = pickle.loads(got[0]) if got is not None else None
        return None if state is None else len(state.participants) + len(state.wait_list)
    except Exception:
        return None


def _first_cause(failures: dict) -> tuple[int, object]:
    """The failure that started it: the earliest of those that are not a victim's exit
    (PEER_FAILURE_EXIT: 'a collective failed because another process did'), else the
    earliest. A victim can exit before the agent notices the death that caused it."""
    causes = {r: f for r, f in failures.items() if f.exitcode != PEER_FAILURE_EXIT}
    pool = causes or failures
    rank = min(pool, key=lambda r: (pool[r].timestamp, r))
    return rank, pool[rank]


def _run_reporting_errors(markers: str, fn: Callable, *args):
    """A launched process's entry: an exception it does not handle is printed here,
    with the process's rank, before the process dies. (The elastic agent files it in
    an error record that nothing shows, which left the parent pointing at a message
    no one printed.) Functions that print their own message exit via SystemExit. A
    process marks its start and its end in the folder `markers` (`worker_watch`)."""
    worker_signal_defaults()  # ignored (and blocked) in the fork server it comes from
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and \
            failure_would_repeat(markers):
        _exit_now(2)  # torch's agent restarts whatever failed; this restart would not help
    stop_on_signals()
    mark_started(markers)
    os.environ[WORKER_MARKERS] = markers
    try:
        # Unblocked once the handlers are in place: a SIGTERM sent while this process
        # started is a stop before the first step, not a death by signal.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SERVER_IGNORES)
        result = fn(*args)
    except Stopped as exc:
        # A SIGTERM that waited while this process started (the server blocks it) arrives
        # as the block lifts, before `fn` can take it for a stop before the first step:
        # it is one all the same (exit 75, not 143) until the trainer takes SIGTERM over.
        if before_stop_request(exc):
            exc = StoppedBeforeStart()
        # Leave at once: the agent sends SIGTERM to every worker once one fails or is
        # signalled, and one arriving during the interpreter's own shutdown would print
        # a traceback.
        _exit_now(exc.exit_code)
    except SystemExit as exc:
        if exc.code == 2:  # an error this process diagnosed and printed (PartitaError)
            mark_failure_would_repeat(markers)
        _exit_now(exc.code if isinstance(exc.code, int) else 1)
    except Exception as exc:
        rank = os.environ.get("RANK", "?")
        if os.environ.get("PARTITA_DEBUG") == "1":
            detail = f":\n{traceback.format_exc()}"
        else:
            detail = (f": {type(exc).__name__}: {str(exc).strip()[:300]}. This is a fault "
                      "inside partita, not in your settings; PARTITA_DEBUG=1 shows the "
                      "traceback to report.")
        print_line(f"partita: process {rank} failed{detail}")
        _exit_now(1)
    # Done: while the agent collects the results, a SIGTERM (another process failed)
    # or Ctrl-C ends this one quietly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: _exit_now(128 + signum))
    mark_finished(markers)
    return result


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
