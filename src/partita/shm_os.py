"""What the shared-memory arena (`partita.shm_collectives`) asks of the operating
system: sleeping on and waking a 32-bit word of shared memory (futex(2), Linux on
x86-64), telling whether two processes run under one kernel (its boot id), and whether a
member's process is still the one that joined (its start time: pids are reused).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import socket

from partita.proc_stat import stat_fields

HOST_BYTES = 16  # a host's identity, as exchanged between members
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = None


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at `addr` holds `expected` (at most `timeout_s`);
    spurious returns are fine, the caller checks again."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _syscall()(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
               ctypes.c_uint32(expected), ctypes.byref(ts), None, ctypes.c_int(0))


def futex_wake(addr: int) -> None:
    _syscall()(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
               ctypes.c_int(2**31 - 1), None, None, ctypes.c_int(0))


def host_id() -> bytes:
    """This machine's kernel, as 16 bytes: its boot id (processes in containers on one
    host share it), else a hash of the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:HOST_BYTES].ljust(
                HOST_BYTES, b"\0")
    except (OSError, ValueError):
        return hashlib.sha256(socket.gethostname().encode()).digest()[:HOST_BYTES]


def identity(pid: int) -> tuple[int, int]:
    """(start time, pid namespace) of process `pid`: a pid names the same process while
    both match. (0, 0) where /proc cannot say."""
    try:
        return int(stat_fields(pid)[19]), os.stat(f"/proc/{pid}/ns/pid").st_ino
    except (OSError, IndexError, ValueError):
        return 0, 0


def alive(peer: tuple[int, int] | None) -> bool:
    """Whether a member's process still runs (True where that cannot be told)."""
    if peer is None:
        return True
    pid, start = peer
    try:
        fields = stat_fields(pid)
    except OSError:
        return False
    return fields[0] not in ("Z", "X", "x") and int(fields[19]) == start
