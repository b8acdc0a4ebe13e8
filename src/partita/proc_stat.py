"""What /proc says about a process: its state, start time and activity (Linux only).

Read by the watches over a job's last workers (`worker_watch`, `watchdog`) and by the
shared-memory collectives, which tell a dead group member from a slow one.
"""

from __future__ import annotations

import os


def stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and
    parentheses): [0] the state, [11] and [12] the user and system CPU ticks, [19] the
    start time. Raises OSError when the process is gone (or there is no /proc: not
    Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def process_state(pid: int) -> str | None:
    """The one-letter state /proc gives process `pid` (R, S, D, T, t, Z...), or None
    when it is gone or the state cannot be read (no /proc: not Linux)."""
    try:
        return stat_fields(pid)[0]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs: it exists (ours or another user's) and has not
    exited waiting to be reaped; without /proc, existing is taken as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but is not ours to signal
        return True
    return process_state(pid) != "Z"


# partita's own threads are named "partita-..." (Python 3.14 and later pass a thread's
# name on to the system; earlier ones leave it the process's). The one that only
# reports on its process (the heartbeat) names itself this, so that its own work is not
# taken for the process's progress.
OWN_THREADS = "partita-"
REPORTER_THREAD = "partita-beat"


def name_this_thread(name: str) -> None:
    """Give the calling thread `name` (at most 15 characters) in /proc; no-op elsewhere."""
    import threading

    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write(name)
    except OSError:
        pass


def activity(pid: int) -> int | None:
    """A number that grows while process `pid` works: the CPU ticks of its own threads
    plus the bytes they read and wrote. Its own threads are the main thread, those that
    kept its name (the threads Python starts) and partita's (OWN_THREADS). Other names
    are left out: native libraries' threads (gloo's, NCCL's, the store's) wake to poll
    when nothing is happening, and the reporter (REPORTER_THREAD) works whatever the
    rest does. None when the process is gone (or there is no /proc: not Linux)."""
    try:
        with open(f"/proc/{pid}/comm") as comm:
            own_name = comm.read().strip()
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        task = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{task}/stat") as stat:
                text = stat.read()  # "tid (name) state ...": the name as in comm
            name, fields = text[text.index("(") + 1:text.rindex(")")], text.rsplit(")", 1)[1]
            ours = name == own_name or tid == str(pid) or name.startswith(OWN_THREADS)
            if not ours or name == REPORTER_THREAD:
                continue
            fields = fields.split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
            with open(f"{task}/io") as io:
                for line in io:
                    key, _, value = line.partition(":")
                    if key in ("rchar", "wchar"):
                        total += int(value)
        except (OSError, IndexError, ValueError):  # the thread ended, or io is not ours
            continue
    return total
