"""Run a function on every rank of a small local world on this machine.

Benchmarks and the test harness (`partita.testing`) start their worlds here, and the
launcher picks its rendezvous port with `free_port`:

    results = run_distributed(fn, world_size=4, args=(config,))

`fn(rank, world_size, *args)` runs in each of `world_size` fresh processes after
`torch.distributed` is initialised (gloo, a free port on 127.0.0.1, one intra-op thread
each). The list of return values, in rank order, comes back; an exception on any rank
is re-raised here with that rank's traceback, and a world that outlives `timeout`
seconds is killed and reported, so a hang fails a test instead of stalling CI.
`backend="nccl"` gives rank r the GPU r (NCCL accepts one rank per GPU), for the GPU
benchmarks; tests use gloo.

Processes start from a fork server that has already imported torch and partita,
which makes a world start in well under a second instead of re-importing torch.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import random
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from partita.errors import PartitaError, PeerFailure, signals_held

_CONTEXT: mp.context.BaseContext | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's
    range of ephemeral ports. A port the kernel hands out (bind to port 0) comes from
    that range, which is also where every outgoing connection (gloo's, a store
    client's) gets its own port: between being picked and being listened on, one taken
    there by another job's connection failed the store with EADDRINUSE."""
    first_ephemeral = _first_ephemeral_port()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(PORTS_FROM, first_ephemeral)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all taken: any
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORTS_FROM = 20_000  # above the ports services usually take


def _first_ephemeral_port() -> int:
    """Where the kernel's range of ports for outgoing connections starts (Linux's
    default where it cannot be read), never below PORTS_FROM + 1000."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(low, PORTS_FROM + 1000)


# A Unix socket's path holds at most 107 bytes. The fork server's lives in
# multiprocessing's temporary folder, `$TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX`: 32
# bytes past TMPDIR.
_SOCKET_PATH_MAX = 107
_SOCKET_SUFFIX = 32


def short_socket_folder() -> None:
    """Make multiprocessing's temporary folder (where the fork server's socket goes) in
    /tmp when TMPDIR is too long for a socket path (a scheduler's per-job folder can
    be), instead of failing the launch with "AF_UNIX path too long". Python 3.13 does
    the same itself; multiprocessing keeps the folder it makes first, so this runs
    before the server starts."""
    from multiprocessing import util

    if len(tempfile.gettempdir()) + _SOCKET_SUFFIX <= _SOCKET_PATH_MAX:
        return
    if not (os.path.isdir("/tmp") and os.access("/tmp", os.W_OK)):
        return  # nothing shorter to offer; the launch reports the error
    saved, tempfile.tempdir = tempfile.tempdir, "/tmp"
    try:
        util.get_temp_dir()
    finally:
        tempfile.tempdir = saved


# What a terminal or a scheduler sends to a whole process group, which the fork server
# ignores: see `start_fork_server`.
SERVER_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Set (to "1") by the command line when it started with SIGHUP ignored (`nohup`).
NOHUP_ENV = "PARTITA_NOHUP"


def note_ignored_hangup() -> None:
    """Record, before anything changes the handlers, whether this command started with
    SIGHUP ignored (`nohup partita train ... &`). The launcher's agent and the workers
    then keep ignoring it, as the user asked: a closed terminal stopped a nohup'd job
    (exit 129) when they set their own handlers. Workers read it from the environment."""
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        os.environ[NOHUP_ENV] = "1"
    else:
        os.environ.pop(NOHUP_ENV, None)


def hangup_ignored() -> bool:
    """Whether the job was started with SIGHUP ignored (`note_ignored_hangup`)."""
    return os.environ.get(NOHUP_ENV) == "1"


def worker_signal_defaults() -> None:
    """The signals a launched process starts from: the defaults, but SIGHUP stays
    ignored in a job started under nohup."""
    for sig in SERVER_IGNORES:
        ignored = sig == signal.SIGHUP and hangup_ignored()
        signal.signal(sig, signal.SIG_IGN if ignored else signal.SIG_DFL)


def start_fork_server(fork_this_process: bool = False) -> None:
    """Start multiprocessing's fork server, its preload set by the caller, ignoring
    `SERVER_IGNORES`.

    `fork_this_process`: the server is a fork of this process, not a fresh interpreter
    (`_server_forked_from_here`); for a caller that has imported torch and run nothing
    with it yet (the launcher).

    Its parent learns its workers' exit codes through it, so it must outlive a SIGTERM
    or SIGHUP sent to the whole job (a scheduler's stop, a closed terminal). It ignores
    Ctrl-C by itself only once its imports are done; ignored from its start, a Ctrl-C
    during those imports (seconds, with torch) no longer prints their traceback. An
    ignored signal stays ignored across the exec that starts the server. While this
    process ignores them the signals are also blocked: Linux discards an ignored signal
    when it is sent but queues a blocked one, so one sent in that moment reaches this
    process's own handler once it is back. The server and its workers inherit the block;
    a worker lifts it once its own handlers are in place (`restore_signals`, or the
    launcher's workers' own)."""
    from multiprocessing import forkserver

    short_socket_folder()
    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()  # only the main thread may set handlers
        return
    # A stop taken as the start ends (the moment below delivers one that waited) used to
    # leave the caller without knowing of the server, which then outlived it by its
    # imports (1-4 s, holding the caller's stdout and stderr). Held, the signal's own
    # handler runs once the server's pid is recorded, and a stop raised there stops it.
    try:
        with signals_held():
            _start_fork_server(fork_this_process)
    except BaseException:
        stop_fork_server()
        raise


def _start_fork_server(fork_this_process: bool) -> None:
    from multiprocessing import forkserver, resource_tracker

    # The standard library's resource tracker first, outside the moment below: the
    # fork server's start would start it there, and its start unblocks SIGINT and
    # SIGTERM (not restoring the mask it found) while they are ignored here, so a
    # SIGTERM in the rest of that moment was discarded and the job trained on.
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, SERVER_IGNORES)
    if fork_this_process:
        # The child, born with them blocked, ignores them itself; this process keeps its
        # handlers, so a signal that reaches one of torch's threads meanwhile (they do
        # not block it) is not discarded, and one queued here is delivered on unblock.
        try:
            with _server_forked_from_here():
                forkserver.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SERVER_IGNORES)
        return
    # Setting SIG_IGN discards a signal already waiting: one that came since the block
    # (a SIGTERM as the job starts, under load: lost, the job trained on) is noted just
    # before and sent again once the handler is back. The server still needs the
    # ignore: threads its imports start may not block the signals. What stays is the
    # moment between the note and the ignore, a few bytecodes.
    previous, waiting = {}, []
    for sig in SERVER_IGNORES:
        if sig in signal.sigpending():
            waiting.append(sig)
        previous[sig] = signal.signal(sig, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SERVER_IGNORES)  # delivers one pending
        for sig in waiting:
            os.kill(os.getpid(), sig)


@contextlib.contextmanager
def _server_forked_from_here():
    """While the standard library starts its fork server, fork this process for it
    instead of starting a fresh interpreter that imports torch again.

    A launcher imports torch itself (torch's elastic agent needs it), and a fresh server
    then imported it a second time: about 2.5 CPU-seconds per job on a 2-core machine,
    a third of what a small two-process job costs. The fork shares the import. It is as
    safe as the fresh server only before this process has run torch code or started
    threads of its own (an OpenMP pool used before a fork hangs the child), so only the
    launcher asks for it, before its checks and the agent. The child runs the very
    command the standard library would have run in the new interpreter, with the file
    descriptors it would have passed; it closes the other ends of those pipes (the
    server ends once every process that holds the write end of its "alive" pipe has
    gone) and leaves without this process's exit handlers.
    """
    import warnings
    from multiprocessing import forkserver, util

    spawn = util.spawnv_passfds

    def fork_instead(path: str, args: list, passfds: list) -> int:
        for stream in (sys.stdout, sys.stderr):  # else every worker writes it again
            with contextlib.suppress(Exception):
                stream.flush()
        with warnings.catch_warnings():  # Python 3.12+ warns of any thread, even idle ones
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid:
            return pid
        status = 1
        try:
            for sig in SERVER_IGNORES:
                signal.signal(sig, signal.SIG_IGN)
            _close_other_pipe_ends(passfds)
            # As a fresh interpreter has it: no server of its own, no lock held (kept as
            # the object the module's functions are bound to).
            forkserver._forkserver.__init__()
            exec(args[-1], {"__name__": "__forkserver__"})  # noqa: S102  (the stdlib's own)
            status = 0
        except SystemExit as exc:  # how the server leaves once its clients have gone
            status = exc.code if isinstance(exc.code, int) else 0
        finally:
            os._exit(status)

    util.spawnv_passfds = fork_instead
    try:
        yield
    finally:
        util.spawnv_passfds = spawn


def _close_other_pipe_ends(passfds: list) -> None:
    """Close every descriptor of a pipe one of `passfds` belongs to, but `passfds`."""
    def pipe(fd: int) -> tuple[int, int] | None:  # both ends of one pipe share it
        info = os.fstat(fd)
        return (info.st_dev, info.st_ino) if stat.S_ISFIFO(info.st_mode) else None

    pipes = {pipe(fd) for fd in passfds} - {None}
    folder = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    for fd in map(int, os.listdir(folder)):
        with contextlib.suppress(OSError):  # the folder's own descriptor, gone by now
            if fd not in passfds and pipe(fd) in pipes:
                os.close(fd)


def stop_fork_server() -> None:
    """Stop the fork server at once (SIGKILL: it ignores the others) and wait until it
    has exited. Left alone it exits after this process, but only after finishing its
    imports (1-4 s), serving whatever it was asked meanwhile and holding this process's
    stdout and stderr open. (multiprocessing has no public call for it: the server's pid
    is read where the standard library keeps it; nothing happens where it is not found.)
    The next world starts a new one."""
    global _CONTEXT
    from multiprocessing import forkserver

    _CONTEXT = None
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _await_exit(pid)


def _await_exit(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until the child `pid` has exited, leaving it for the standard library to
    reap. Its `ensure_running` takes a server that has not exited yet for a live one, so
    a process starting right after a kill (a second `partita train` in one Python
    session, a test world) would connect to a dying server and fail with EOFError or
    "Connection refused"."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return
        except ChildProcessError:
            return  # not our child, or reaped already: nothing to wait for
        time.sleep(0.002)


def _kill_started(procs: list) -> None:
    """SIGKILL every worker of `procs` still running, while the fork server can still
    tell (a SIGTERM that reached this process alone, `kill PID` or a scheduler's stop,
    does not reach them)."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()


def restore_signals() -> None:
    """In a process forked from the server: the signals as a fresh Python process has
    them (Ctrl-C raises KeyboardInterrupt, SIGTERM and SIGHUP end it, SIGHUP ignored
    under nohup), unblocked."""
    worker_signal_defaults()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SERVER_IGNORES)


def _context() -> mp.context.BaseContext:
    global _CONTEXT  # one fork server per test session is the point of having one
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        # What nearly every world imports (the parity harness pulls in the trainer and the
        # parallel layers): each rank would otherwise import it again, ~0.3 s apiece.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "partita.local_world",
                                    "partita.testing", "partita.trainer"])
        start_fork_server()
        _CONTEXT = ctx
    return _CONTEXT


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple,
            results: mp.Queue, collective_timeout: float, backend: str) -> None:
    restore_signals()  # the server's are ignored (start_fork_server)
    import torch
    import torch.distributed as dist

    from partita.host_memory import keep_freed_host_memory

    torch.set_num_threads(1)
    keep_freed_host_memory()  # as `partita train` ranks on CPU do
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        # Plain pickle copies tensor data into the message; the queue's own pickler
        # would share storages by file descriptor, which breaks once this process exits.
        value = pickle.dumps(fn(rank, world_size, *args))
        results.put((rank, True, value))
    except PartitaError as exc:
        # Bad input found by a rank (a layout the model cannot take): its message is
        # the whole story. A peer's failure or timeout keeps its traceback.
        # Sent as a plain PartitaError: a subclass may take other arguments, and fail
        # to unpickle on the other side.
        results.put((rank, False, PartitaError(str(exc)) if not isinstance(exc, PeerFailure)
                     else traceback.format_exc()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankRefused(PartitaError, RuntimeError):
    """A rank of `run_distributed` stopped on bad input (a PartitaError): shown as one
    line by the command line, and still a RuntimeError for callers that catch those."""


class RankKilled(PartitaError, RuntimeError):
    """A rank of `run_distributed` was killed by a signal. The other ranks' errors (a
    connection reset by their peer) only follow from its death, so it is what to report."""


def _killed_rank(procs: list, grace_s: float) -> tuple[int, int] | None:
    """(rank, signal) of a rank that a signal killed, waiting up to `grace_s` for one:
    the survivors see the closed connection a moment before the exit status arrives."""
    deadline = time.monotonic() + grace_s
    while True:
        for rank, p in enumerate(procs):
            if p.exitcode is not None and p.exitcode < 0:
                return rank, -p.exitcode
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _killed_error(rank: int, world_size: int, signum: int, then: str = "") -> RankKilled:
    name = signal.Signals(signum).name
    why = ("most often the kernel's out-of-memory killer (`dmesg` says so): give the ranks "
           "less to hold (a smaller model or batch, fewer ranks) or the machine more memory"
           if signum == signal.SIGKILL else "a crash in native code or a kill from outside")
    return RankKilled(f"rank {rank} of {world_size} was killed by {name}, {why}.{then}")


# Words of the errors a rank raises when a peer's process is gone (gloo's TCP pairs say
# "... by peer" or "broken pipe", the shared-memory arena "the process of peer rank").
_PEER_GONE = ("peer", "broken pipe")


def _rank_failed(rank: int, world_size: int, trace: str, procs: list) -> RuntimeError:
    """The error for a rank that raised: its traceback, unless another rank was killed,
    in which case that rank is the cause and this one's last line what followed."""
    gone = any(word in trace.lower() for word in _PEER_GONE)
    killed = _killed_rank(procs, grace_s=3.0 if gone else 0.0)
    if killed is None:
        return RuntimeError(f"rank {rank} of {world_size} failed:\n{trace}")
    last = trace.strip().splitlines()[-1][:300]
    return _killed_error(killed[0], world_size, killed[1],
                         f" Rank {rank} then failed: {last}")


def run_distributed(fn: Callable[..., Any], world_size: int, args: tuple = (),
                    timeout: float = 180.0, backend: str = "gloo") -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return their results."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results,
                                          max(timeout - 5, 5), backend), daemon=True)
        for r in range(world_size)
    ]
    out: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        for p in procs:
            p.start()  # waits while the server still imports its preload
        while len(out) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
                    "(a hang: some rank is waiting for a collective another skipped)"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None) and r not in out]
                if dead:
                    code = procs[dead[0]].exitcode
                    if code < 0:
                        raise _killed_error(dead[0], world_size, -code) from None
                    raise RuntimeError(f"rank {dead[0]} died with exit code {code}") from None
                continue
            if isinstance(value, PartitaError):
                raise RankRefused(f"rank {rank} of {world_size} failed: {value}") from None
            if not ok:
                raise _rank_failed(rank, world_size, value, procs) from None
            out[rank] = pickle.loads(value)
    except BaseException as exc:
        if not isinstance(exc, Exception):
            # Ctrl-C or a stop: this process is leaving, and a worker the server starts
            # for it now would find its queue gone and print a traceback about that.
            # The workers go first: they are the server's children, and once it is gone
            # their exit can no longer be read (`is_alive` says False) while they run on.
            _kill_started(procs)
            stop_fork_server()
        raise
    finally:
        for p in procs:
            if p.pid is None:
                continue  # never started
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
