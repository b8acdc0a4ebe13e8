"""One file in /dev/shm, mapped by every member of a gloo group that runs on one host.

The shared-memory transports (`partita.shm_collectives` for a group's collectives,
`partita.pipeline.shm_channel` for pipeline transfers) each lay their own structure over
such a file; this module makes it. Setup is collective: every member calls `share` at
the same point of the group's collective sequence. One member creates the file and
reserves its space (`posix_fallocate`: writing past a full tmpfs would raise SIGBUS, not
an error), writes a random token and broadcasts the name, the token and its host's boot
id over the group; the others map the file and check the token (which proves they share
the filesystem), and one all-gather agrees on the outcome and tells every member who the
others are (so that a wait can tell a member whose process ended from one that is late).
The creator then unlinks the file, so a crash leaves nothing behind. Where anything
fails, `share` returns None on every member: quietly where a member runs on another host
(a group that spans hosts is expected), with one warning otherwise (a missing, full or
private /dev/shm on one host).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import re
import secrets
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from partita import shm_os
from partita.comm import dist_all_gather_flat
from partita.proc_stat import pid_alive

# Set to 0 to keep gloo's TCP transfers where `Mesh(shm_collectives=...)` is not given
# (on by default: figures in docs/benchmarks.md, "Every collective through the arena").
ENV_SWITCH = "PARTITA_SHM_COLLECTIVES"
SHM_DIR = "/dev/shm"
_TOKEN_BYTES = 16
_NAME_BYTES = 128
_MAPPED, _FAILED, _ELSEWHERE = 1, 0, 2  # what each member reports after setup
_CHECK_S = 0.5  # while waiting, how often to look whether the awaited process ended
# A file whose maker has ended and that is older than this was left by a process killed
# (SIGKILL, the out-of-memory killer) between making it and unlinking it: a setup takes
# seconds, and a maker in another pid namespace that only looks ended is long done too.
STALE_S = 600.0
_NAME = re.compile(r"partita-(\d+)-[0-9a-f]{16}")
_warned = False


class ShmTimeout(dist.DistError):
    """A member did not reach a shared-memory transfer within the group's timeout, or
    its process ended (a DistError, as gloo's own failures are)."""


def wanted(choice: bool | None) -> bool:
    """The caller's choice, or where it made none the environment's (on unless
    PARTITA_SHM_COLLECTIVES=0)."""
    if choice is not None:
        return choice
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def supported() -> bool:
    """The platform has what the shared-memory waits need (futex(2) and the ordering of
    plain stores: Linux on x86-64)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def warn_once(what: str, why: str) -> None:
    """One warning per process that `what` keeps gloo's TCP, and why."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"partita: {what} go through gloo's TCP forms: {why}",
                      RuntimeWarning, stacklevel=3)


def group_timeout(group: dist.ProcessGroup) -> float:
    """The group's collective timeout, in seconds: how long a wait on a member may last."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # an older or other backend: torch's default for new groups
        return 1800.0


def wait_while(addr: int, value: int, timeout_s: float, peer: tuple[int, int] | None,
               what: str, who: str) -> None:
    """Sleep while the 32-bit word at `addr` holds `value` (another process changes it
    and wakes us). ShmTimeout after `timeout_s`, or as soon as the process of `peer`
    (the one awaited, see `shm_os.alive`) has ended; the message names `what` waited
    for `who`."""
    word = ctypes.c_uint32.from_address(addr)
    deadline = None
    while word.value == value:
        now = time.monotonic()
        if deadline is None:
            deadline = now + timeout_s
        elif now >= deadline:
            raise ShmTimeout(f"{what} timed out: {who} did not arrive within {timeout_s:g} s")
        elif not shm_os.alive(peer):
            raise ShmTimeout(f"{what} failed: the process of {who} has ended")
        shm_os.futex_wait(addr, value, min(deadline - now, _CHECK_S))


@dataclass
class Shared:
    """A file every member has mapped (`arena`: its bytes) and who the members are."""

    mm: mmap.mmap
    arena: torch.Tensor
    peers: list[tuple[int, int] | None]  # per member, for `shm_os.alive`
    timeout_s: float
    path: str | None  # on the member that made it (unlinked already), for tests


def share(group: dist.ProcessGroup, ranks: list[int], index: int, nbytes: int,
          what: str) -> Shared | None:
    """Map one file of `nbytes` on every member (collective); None on every member where
    any cannot. `what` names the transfers that keep gloo in the warning."""
    msg = torch.zeros(_NAME_BYTES + _TOKEN_BYTES + shm_os.HOST_BYTES, dtype=torch.uint8)
    token_at, host_at = _NAME_BYTES, _NAME_BYTES + _TOKEN_BYTES
    host = shm_os.host_id()
    path, fd, why = None, -1, ""
    if index == 0:
        token = secrets.token_bytes(_TOKEN_BYTES)
        try:
            path, fd = _create(nbytes, token)
            name = path.encode()
            msg[:len(name)] = torch.frombuffer(bytearray(name), dtype=torch.uint8)
            msg[token_at:host_at] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
        except (OSError, ValueError) as exc:
            why = f"cannot make an arena of {nbytes >> 20} MiB in {SHM_DIR} ({exc})"
            if getattr(exc, "errno", None) == errno.ENOSPC:  # a container's 64 MB
                why += (f"; each gloo group of one host takes {nbytes >> 20} MiB there: "
                        "give it room (docker run --shm-size=1g) or set "
                        f"{ENV_SWITCH}=0 to keep gloo's TCP forms quietly")
        msg[host_at:] = torch.frombuffer(bytearray(host), dtype=torch.uint8)
    try:
        dist.broadcast(msg, src=ranks[0], group=group)
        raw = bytes(msg.tolist())
        name = raw[:_NAME_BYTES].rstrip(b"\0").decode()
        mm = None
        elsewhere = raw[host_at:] != host
        try:
            if elsewhere:
                raise OSError("the first member runs on another host")
            if not name:
                raise OSError("the first member could not make the arena")
            if fd < 0:
                fd = os.open(name, os.O_RDWR)
            mm = mmap.mmap(fd, nbytes)
            if mm[:_TOKEN_BYTES] != raw[token_at:host_at]:
                raise OSError("the members do not share /dev/shm (a private one per container?)")
        except (OSError, ValueError) as exc:
            why = why or f"no shared arena ({exc})"
            mm = None
        mapped = _ELSEWHERE if elsewhere else _FAILED if mm is None else _MAPPED
        me = torch.tensor([[mapped, os.getpid(), *shm_os.identity(os.getpid())]],
                          dtype=torch.int64)
        every = torch.empty((len(ranks), 4), dtype=torch.int64)
        dist_all_gather_flat(every, me, group=group)
    finally:
        # Every member has mapped it or given up by now (a mapping outlives its file
        # descriptor); where a collective above failed (a member died), unlink it all
        # the same: a file left behind would hold its memory until the machine restarts.
        if fd >= 0:
            os.close(fd)
        if path is not None:
            os.unlink(path)
    namespace = me[0, 3].item()
    peers = [(pid, start) if ns == namespace and ns != 0 else None
             for _, pid, start, ns in every.tolist()]
    states = set(every[:, 0].tolist())
    if states != {_MAPPED}:
        if _ELSEWHERE not in states:
            warn_once(what, why or "another member could not map the shared arena")
        return None
    return Shared(mm, torch.frombuffer(mm, dtype=torch.uint8), peers, group_timeout(group),
                  path)


def whole_pages(nbytes: int) -> int:
    """`nbytes` rounded up to whole 4 KiB pages (a shared file's header before the
    buffers that follow it)."""
    return -(-nbytes // 4096) * 4096


def _create(nbytes: int, token: bytes) -> tuple[str, int]:
    """A new file of `nbytes` in /dev/shm with `token` at its start: (path, fd)."""
    if not os.path.isdir(SHM_DIR):
        raise OSError(errno.ENOENT, f"{SHM_DIR} does not exist")
    sweep_stale()
    path = os.path.join(SHM_DIR, f"partita-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # the pages exist, or this fails here
        os.pwrite(fd, token, 0)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return path, fd


def sweep_stale(now: float | None = None) -> list[str]:
    """Remove this user's files in /dev/shm that a killed maker left (see STALE_S); the
    names removed. A live setup's file is never older than its setup, and every setup
    unlinks its file when it ends, by any path but a kill."""
    now = time.time() if now is None else now
    return _remove_left(lambda pid, st: now - st.st_mtime >= STALE_S)


def remove_left_by(pids: Iterable[int]) -> list[str]:
    """Remove the files in /dev/shm that processes `pids` made and, killed, did not
    unlink (the launcher's call once its workers have ended); the names removed."""
    ended = set(pids)
    return _remove_left(lambda pid, st: pid in ended)


def _remove_left(chosen: Callable[[int, os.stat_result], bool]) -> list[str]:
    """Unlink this user's partita files in /dev/shm whose maker no longer runs and that
    `chosen(maker pid, stat)` picks."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None:
            continue
        path, pid = os.path.join(SHM_DIR, name), int(match.group(1))
        try:
            st = os.stat(path)
            if st.st_uid != os.getuid() or not chosen(pid, st) or pid_alive(pid):
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed
