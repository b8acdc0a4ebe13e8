"""DeepSpeed as a benchmark peer: imported for the CPU, after a check that its build can
finish.

On a CPU DeepSpeed compiles its shared-memory collectives (and CPU Adam) with torch's
extension builder the first time a process needs them. That builder takes a lock file
in its build folder and every other process waits for the file to go away, with no
limit; a build that was interrupted (Ctrl-C, a timeout, a killed benchmark) leaves the
file behind, and every later benchmark with DeepSpeed then waits forever. A lock older
than any build takes is refused here with its path.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import ModuleType

from partita.errors import PartitaError

# Builds of DeepSpeed's CPU ops took 20-60 s on the 2-core machine; a lock this old
# belongs to no build still running.
STALE_LOCK_S = 600.0


def import_deepspeed() -> ModuleType:
    """`deepspeed`, set to the CPU accelerator (its documented switch, DS_ACCELERATOR)
    where the caller chose none."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    check_build_locks()
    import deepspeed

    return deepspeed


def check_build_locks(root: Path | None = None, now: float | None = None) -> None:
    """Raise PartitaError naming each lock in torch's extension build folder (`root`,
    default torch's) older than STALE_LOCK_S."""
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = Path(get_default_build_root())
    now = time.time() if now is None else now
    stale = []
    for lock in root.glob("*/*/lock"):
        try:
            age = now - lock.stat().st_mtime
        except OSError:  # released meanwhile
            continue
        if age > STALE_LOCK_S:
            stale.append((lock, age))
    if stale:
        listed = ", ".join(f"{lock} ({age / 60:.0f} min old)" for lock, age in stale)
        raise PartitaError(
            f"an interrupted build of a compiled extension left its lock file: {listed}. "
            "DeepSpeed's build of its CPU ops would wait for it forever; delete it "
            f"(rm {' '.join(str(lock) for lock, _ in stale)}) and run the benchmark again, "
            "or leave DeepSpeed out (--no-deepspeed where the benchmark offers it).")
