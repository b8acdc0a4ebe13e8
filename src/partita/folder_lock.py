"""One job at a time in a run's folders.

Two jobs writing into the same `train.out_dir` (or checkpoint folder) mix their files:
each run's start removes the other's half-written checkpoint, `keep_last` prunes the
other's checkpoints, and both append to one `metrics.jsonl`. The checks of `run_dir`
look only at what is already there, so two jobs started close together, or a
`train.resume=auto` while the first job still runs (a scheduler's requeue), both pass
them. So a job holds an exclusive lock on each of its folders from before it changes
anything in them until it ends: `flock` on a `LOCK_FILE` in the folder, which the
kernel releases when the process that holds it exits, however it exits.

The lock is taken by the process that prepares the folders and outlives the workers:
`partita train`'s launcher, or rank 0 under torchrun. A job of several nodes takes none
(each node's launcher prepares the folders; docs/troubleshooting.md). A filesystem that
takes no locks (some network mounts) runs the job without one.

Disk offload's folder (`parallel.offload_dir`) is locked by each rank on its own lock
file (`lock_folder(..., name=...)`), by the worker that writes that rank's files, for as
long as it has them open: ranks may be on several nodes, each with a folder of its own.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import IO

from partita.errors import PartitaError

LOCK_FILE = ".partita.lock"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


MIX = "mix and delete each other's files"


def _in_use(folder: Path, setting: str, holder: str, inside: bool = False,
            harm: str = MIX) -> PartitaError:
    where = "is inside a folder" if inside else "is"
    return PartitaError(
        f"{setting} '{folder}' {where} in use by another partita job "
        f"({holder or 'holder unknown'}); two jobs in one folder would {harm}. Wait for "
        f"that job to end (or stop it), or give this one another {setting}."
    )


def check_not_in_use(folder: str | os.PathLike, setting: str) -> None:
    """Refuse, changing nothing, when a live job holds the lock of `folder` or of a
    folder it is in (a run's default checkpoint folder is covered by its out_dir's)."""
    path = Path(folder).absolute()
    for where in (path, *path.parents):
        try:
            fd = os.open(where / LOCK_FILE, os.O_RDONLY)
        except OSError:  # no lock file (or no folder): nobody holds it
            continue
        with os.fdopen(fd) as probe:
            try:
                fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = probe.read().strip()
                raise _in_use(Path(folder), setting, holder, where != path) from None
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    raise


def lock_folder(folder: str | os.PathLike, setting: str, name: str = LOCK_FILE,
                harm: str = MIX) -> IO[str] | None:
    """Hold `folder`'s lock (its lock file `name`) for as long as the returned file stays
    open (None where its filesystem takes no locks); PartitaError, saying what two jobs
    there would do (`harm`), when another job holds it."""
    path = Path(folder)
    handle = open(path / name, "a+")  # noqa: SIM115 (held open: that is the lock)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip()
        handle.close()
        raise _in_use(path, setting, holder, harm=harm) from None
    except OSError as exc:
        handle.close()
        if exc.errno in _NO_LOCKS:
            return None
        raise
    handle.truncate(0)
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    return handle
