"""What /proc says about a process: its state and start time (Linux only).

Read by the launcher's watch over stopped workers (`worker_watch`) and by the
shared-memory collectives, which tell a dead group member from a slow one.
"""

from __future__ import annotations

import os


def stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and
    parentheses): [0] the state, [19] the start time. Raises OSError when the process is
    gone (or there is no /proc: not Linux)."""
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
