"""Ranks on one machine compile each identical graph once; the others read the cache.

Every rank of a data-parallel job traces the same block and hands inductor the same
graph. Started together, they all miss inductor's on-disk caches (the FX graph cache
and AOTAutograd's) and compile it side by side: on a CPU machine, where the ranks and
the C++ compiler share the cores, that is N times the work of one compile. Here the
compile of each graph holds an exclusive file lock named after the graph (its code,
its inputs' shapes, strides, dtypes and devices, and the values of the tensors it
holds as constants), so the first rank compiles and fills the caches, and the others,
waiting on the same lock, then find the result there. Graphs that differ (pipeline
stages, context-parallel chunks with their own rotary tables) take different locks and
compile in parallel as before; so do identical graphs on different devices (each GPU
rank's inputs name its own device, and the caches key on it). The lock is held only
while inductor compiles, never across a collective, and the operating system releases
it if its process dies; a rank waits at most `WAIT_S` for it (a rank stopped mid-compile
would hold it), then compiles for itself. With inductor's caches turned off there is
nothing to share, and the ranks compile side by side as before, without the lock.

Measured on 2 cores (tests/dist/test_compile_parity.py, 2 ranks, cold caches,
2026-12-03): the rank that waits spends 8 s of CPU on a block's first step against 44 s
for the rank that compiles, and the whole test 227 CPU-seconds against 269.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

# The longest a rank waits for another's compile of the same graph. A rank stopped while
# it compiles would otherwise hold the others here, outside any collective whose timeout
# could end the job; past this they compile for themselves, as without the lock.
WAIT_S = 300.0


def graph_key(gm: torch.fx.GraphModule, example_inputs: list) -> str:
    """A digest of what makes two dynamo graphs the same compile."""
    digest = hashlib.sha256(gm.code.encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            digest.update(repr((tuple(x.shape), x.stride(), x.dtype, x.device)).encode())
        else:
            digest.update(repr(x).encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if isinstance(value, torch.Tensor):
                digest.update(value.detach().cpu().contiguous().view(-1)
                              .view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


@contextmanager
def _exclusive(path: Path, wait_s: float) -> Iterator[None]:
    """Hold the lock at `path`; after `wait_s` without it, go on without it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break  # the holder is stopped or stuck: compile as if alone
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock if it was taken


def once_per_machine(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """A `torch.compile` backend: inductor, one rank at a time per identical graph."""
    import torch._inductor.config as inductor
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if inductor.force_disable_caches or not inductor.fx_graph_cache:
        return _repairing(compile_fx, gm, example_inputs)  # nothing to share: no turns
    lock = Path(cache_dir()) / "partita-locks" / f"{graph_key(gm, example_inputs)}.lock"
    # The backward too, inside the lock: AOTAutograd compiles it lazily by default, at
    # the first backward, and caches the pair only then, too late for the next rank.
    with _exclusive(lock, WAIT_S), torch._functorch.config.patch(
            force_non_lazy_backward_lowering=True):
        return _repairing(compile_fx, gm, example_inputs)


def _repairing(compile_fx: Callable, gm: torch.fx.GraphModule, example_inputs: list
               ) -> Callable:
    """`compile_fx`, once more after removing a cached kernel that cannot be loaded.

    Inductor's C++ compiler writes each kernel's library straight to its place in the
    cache, and a process killed during that write (Ctrl-C twice, SIGKILL, a job's time
    limit) leaves an empty or cut-off file there. Every later compile that needs the
    kernel then finds the file and fails to load it ("file too short") until someone
    deletes it by hand. The broken library is deleted here and the graph compiled again,
    which rebuilds it; a second failure is raised as it is.
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    try:
        return compile_fx(gm, example_inputs)
    except ImportError as exc:
        broken = Path(exc.path) if getattr(exc, "path", None) else None
        inside = broken is not None and Path(cache_dir()).resolve() in broken.resolve().parents
        if not (inside and broken.suffix == ".so" and broken.is_file()):
            raise
        if _remove_unloadable(broken, Path(cache_dir())):
            print(f"partita: note: removed a compiled kernel that a stopped compile left "
                  f"incomplete in inductor's cache ({broken}: "
                  f"{exc.msg.rsplit(': ', 1)[-1]}); compiling it again.",
                  file=sys.stderr, flush=True)
        return compile_fx(gm, example_inputs)


def _remove_unloadable(library: Path, cache: Path) -> bool:
    """Delete `library` if it still cannot be loaded; True if it was deleted.

    Under inductor's own lock for that kernel (the one its builds take), so a rank never
    deletes a library another rank has just rebuilt, nor one being written.
    """
    from torch.utils._filelock import FileLock

    lock = cache / "locks" / f"{library.name.split('.')[0]}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock), timeout=WAIT_S):
        try:
            ctypes.CDLL(str(library))
            return False  # rebuilt meanwhile
        except OSError:
            library.unlink(missing_ok=True)
            return True
