"""ZeRO-Infinity: master weights and Adam moments (and ZeRO-3 parameter shards) in files,
updated in sub-groups through a bounded set of host buffers.

    disk = DiskOptimizer.create(owned_params, grad_dtypes, decay, master_dtype,
                                directory, budget_bytes, tag="rank0")
    disk.step(order, owned_params, owned_grads, step, lr, cfg)

Each bucket's owned slice is cut into sub-groups of `subgroup` elements. A step walks
them in the order the next forward needs the buckets, through `SETS` buffer sets (read
ahead, being updated, being written back); a set holds a sub-group's master, both
moments (and, when the gradients are not in host memory already, its gradient), so the
engine's buffers never take more than the budget. A reader thread prefetches the next
sub-groups' states while the CPU updates the current one; a writer thread writes
updated ones back.

File layout and I/O: a bucket's file holds one record per sub-group, [master |
exp_avg | exp_avg_sq] of that sub-group, back to back, so a sub-group is one
sequential read and one sequential write: a single `os.preadv` / `os.pwritev` of three
buffers straight into the tensors' memory (no copies; the GIL is released while they
run). A sub-group's states are whole multiples of `ALIGN` bytes and the buffers are
`ALIGN`-aligned, so every full record goes through `O_DIRECT`: the page cache is
bypassed (it would hold the whole state, the memory the budget is there to bound, and
copy every byte once more), and the reads and writes run at the disk's own rate. A
bucket's last, shorter record, and any file system that refuses `O_DIRECT` (tmpfs),
use ordinary buffered I/O on the same layout; the two never share a page (a tail
starts at an aligned offset). Measured on a shared 2-core machine's virtual disk, one process,
the benchmark's 3.5M-parameter model (partita bench offload): buffered, with one
read, update and write per state, the pipeline ran at 20-45% of the buffered
sequential rate, its reads and writes contending with the update for two shared cores
and for page-cache copies; see docs/memory.md for the direct figures.

One job per rank's files: a rank's files are named by its tag (`rank{R}`), so two jobs
sharing an offload folder would overwrite each other's states without a sign. Before
it touches the folder, the optimizer takes an exclusive lock on `{tag}.lock` there
(`partita.folder_lock`: `flock`, released by the kernel when the process exits,
however it exits, so a killed job leaves nothing behind that blocks the next, and a
restarted worker finds the lock free) and holds it until `close`; a second job's rank
of the same tag is refused, naming the holder, before it writes anything. Optimizers
of one tag in one process (a model built again) share the lock.

Two generations of files: a step reads generation g and writes g ^ 1, and only when
every sub-group is written does g ^ 1 become current. A read or write that fails stops
the step with an error naming the file; the current generation on disk is untouched, so
the optimizer state there stays whole (the device parameters of the sub-groups already
updated have moved on: resume from a checkpoint).
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from partita.errors import PartitaError
from partita.folder_lock import lock_folder
from partita.optim import AdamWConfig, adamw_, adamw_scratch

SETS = 3  # buffer sets in flight: read ahead, update, write back
ALIGN = 4096  # bytes: O_DIRECT's alignment of memory, offsets and lengths (any device)
MIN_SUBGROUP = 4096  # elements: smaller reads cost more in calls than they move
STATES = ("master", "exp_avg", "exp_avg_sq")


def subgroup_elements(budget_bytes: int, master_dtype: torch.dtype,
                      grad_dtype: torch.dtype, param_dtype: torch.dtype | None = None,
                      stage_grads: bool = True) -> int:
    """The largest sub-group whose SETS buffer sets (and, when gradients are cast to the
    master dtype, the cast's scratch) fit in `budget_bytes`; raises when not even
    MIN_SUBGROUP elements fit. `stage_grads`: the sets hold a gradient buffer each (the
    gradients are on a GPU)."""
    per = SETS * (3 * master_dtype.itemsize + stage_grads * grad_dtype.itemsize
                  + (param_dtype.itemsize if param_dtype is not None else 0))
    if grad_dtype != master_dtype:
        per += master_dtype.itemsize  # adamw_'s cast scratch, at most a sub-group
    # The sets' states share one block, over-allocated by ALIGN bytes to align it; a
    # sub-group is a whole number of ALIGN bytes of states, so full records are aligned.
    granule = ALIGN // master_dtype.itemsize
    n = int((budget_bytes - ALIGN) // per) // granule * granule
    if n < MIN_SUBGROUP:
        raise PartitaError(
            f"parallel.host_memory_budget_gb={budget_bytes / 1e9:g} is smaller than one "
            f"disk-offload sub-group: {SETS} buffer sets of {MIN_SUBGROUP} elements need "
            f"{per * MIN_SUBGROUP + ALIGN} bytes. Raise the budget.")
    return n


def disk_bytes_needed(elements: int, master_dtype: torch.dtype) -> int:
    """Bytes the files of `elements` owned elements take (two generations of three
    states)."""
    return 2 * len(STATES) * elements * master_dtype.itemsize


def check_offload_dir(directory: str, bytes_needed: int) -> None:
    """Before training: the directory exists, is writable and has room for the files."""
    path = Path(directory) if directory else None
    if path is None:
        raise PartitaError(
            f"disk offload writes the optimizer state ({bytes_needed:,} bytes) into "
            "parallel.offload_dir, which is not set: give a folder on a fast local disk, "
            "e.g. --parallel.offload_dir=/scratch/offload, or set parallel.offload to a "
            "mode without disk.")
    if path.exists() and not path.is_dir():
        raise PartitaError(
            f"parallel.offload_dir={directory!r} is a file, not a folder; disk offload "
            f"writes the optimizer state there ({bytes_needed:,} bytes). Give a folder (it "
            "is created when missing), or set parallel.offload to a mode without disk.")
    try:  # created when missing, like the run's other folders
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PartitaError(
            f"parallel.offload_dir={directory!r} cannot be created ({exc.strerror or exc}); "
            "give a folder on a writable local disk.") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise PartitaError(f"parallel.offload_dir={directory!r} is not writable; disk "
                           f"offload needs to write {bytes_needed:,} bytes there.")
    free = shutil.disk_usage(path).free
    if free < bytes_needed:
        raise PartitaError(
            f"parallel.offload_dir={directory!r} has {free:,} bytes free, but disk offload "
            f"needs {bytes_needed:,} (master weights and two Adam moments, two generations). "
            "Free space or choose another directory.")


# This process's rank locks: lock file -> [its handle (None: the file system takes no
# locks), the optimizers holding it].
_HELD: dict[Path, list] = {}
_HELD_GUARD = threading.Lock()


def _lock_tag(directory: Path, tag: str) -> Path:
    """Hold the lock of `tag`'s files in `directory` (until `_unlock_tag`): PartitaError
    naming the folder and the other job when another process holds it."""
    key = (directory / f"{tag}.lock").absolute()
    with _HELD_GUARD:
        if key in _HELD:  # this process holds it already: a model built again
            _HELD[key][1] += 1
        else:
            _HELD[key] = [lock_folder(directory, "parallel.offload_dir", name=key.name,
                                      harm="overwrite each other's optimizer states"), 1]
    return key


def _unlock_tag(key: Path) -> None:
    with _HELD_GUARD:
        entry = _HELD.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _HELD[key]
            if entry[0] is not None:
                entry[0].close()


def _aligned(nbytes: int) -> torch.Tensor:
    """`nbytes` of host memory starting at an ALIGN-aligned address (O_DIRECT's rule)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


@dataclass
class _Set:
    """Host buffers for one sub-group: its three states, contiguous in one aligned
    block (a record's layout on disk), and its gradient."""

    block: torch.Tensor  # uint8, the three states back to back
    states: list[torch.Tensor]
    grad: torch.Tensor | None  # None: the gradients are in host memory, read in place
    param: torch.Tensor | None = None  # the updated parameters, when they live on disk
    task: tuple[int, int, int] | None = None  # (bucket, start, stop)


def _io(fn, fd: int, path: Path, buffers: list[torch.Tensor], offset: int,
        what: str) -> None:
    views = [memoryview(t.view(torch.uint8).numpy()) for t in buffers]  # bf16 included
    nbytes = sum(v.nbytes for v in views)
    try:
        done = fn(fd, views, offset)
    except OSError as exc:
        raise PartitaError(f"disk offload: {what} {path} at byte {offset} failed: {exc}. "
                           "The optimizer state of the previous step is intact on disk.") from exc
    if done != nbytes:
        raise PartitaError(f"disk offload: {what} {path} at byte {offset} moved {done} of "
                           f"{nbytes} bytes (file truncated?). The optimizer state of "
                           "the previous step is intact on disk.")


class _Files:
    """One bucket's file of one generation, open for a step: an O_DIRECT descriptor for
    the full records (when the file system takes it) and a buffered one for the tail."""

    def __init__(self, path: Path, flags: int, direct: bool) -> None:
        self.path = path
        self.buffered = os.open(path, flags)
        self.direct = os.open(path, flags | os.O_DIRECT) if direct else self.buffered

    def fd(self, aligned: bool) -> int:
        return self.direct if aligned else self.buffered

    def close(self) -> None:
        if self.direct != self.buffered:
            os.close(self.direct)
        os.close(self.buffered)


def _supports_direct(directory: Path) -> bool:
    """Whether files in `directory` can be opened with O_DIRECT (tmpfs: no)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / f".direct-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    finally:
        if probe.exists():
            probe.unlink()
    os.close(fd)
    return True


class DiskOptimizer:
    """AdamW states of each bucket's owned slice in files, stepped in sub-groups."""

    def __init__(self, sizes: list[int], decay: list[list[tuple[int, int]]],
                 master_dtype: torch.dtype, grad_dtype: torch.dtype, directory: Path,
                 budget_bytes: int, tag: str, param_dtype: torch.dtype | None = None,
                 stage_grads: bool = True, direct: bool | None = None) -> None:
        self.sizes, self.decay, self.dtype = sizes, decay, master_dtype
        self.param_dtype = param_dtype  # set: the parameter shards live in files too
        self.subgroup = subgroup_elements(budget_bytes, master_dtype, grad_dtype, param_dtype,
                                          stage_grads)
        # No larger than the largest bucket needs (rounded up to stay aligned).
        largest = max(sizes, default=1)
        granule = ALIGN // master_dtype.itemsize
        self.subgroup = min(self.subgroup, -(-largest // granule) * granule)
        self.directory = Path(directory)
        # Before anything is written there: another job's rank of this tag would
        # overwrite these files, and this rank its.
        self._unlock = weakref.finalize(self, _unlock_tag, _lock_tag(self.directory, tag))
        self.direct = _supports_direct(self.directory) if direct is None else direct
        state_bytes = self.subgroup * master_dtype.itemsize
        record = len(STATES) * state_bytes
        self.block = _aligned(SETS * record)  # every set's states, ALIGN-aligned
        self.sets = []
        for i in range(SETS):
            block = self.block[i * record:(i + 1) * record]
            states = [block[k * state_bytes:(k + 1) * state_bytes].view(master_dtype)
                      for k in range(len(STATES))]
            # On a GPU the gradients are copied in per sub-group; on the CPU they are
            # host memory already and the update reads them where they are.
            grad = torch.empty(self.subgroup, dtype=grad_dtype) if stage_grads else None
            param = None if param_dtype is None else torch.empty(self.subgroup,
                                                                 dtype=param_dtype)
            self.sets.append(_Set(block, states, grad, param))
        self.scratch = adamw_scratch(self.subgroup if grad_dtype != master_dtype else 0,
                                     master_dtype, torch.device("cpu"))
        self.paths = [[self.directory / f"{tag}.bucket{b}.gen{g}.bin" for g in (0, 1)]
                      for b in range(len(sizes))]
        self.param_paths = ([self.directory / f"{tag}.params{b}.bin" for b in range(len(sizes))]
                            if param_dtype is not None else [])
        self.generation = 0
        self.copies: list[tuple[str, int, int]] = []  # ("read"|"adam"|"write", bucket, start)
        self.bytes_read = self.bytes_written = 0
        self.seconds = 0.0  # wall time of the steps' read-update-write pipelines

    @classmethod
    def create(cls, owned_params: list[torch.Tensor], grad_dtypes: list[torch.dtype],
               decay: list[list[tuple[int, int]]], master_dtype: torch.dtype,
               directory: str, budget_bytes: int, tag: str,
               params_on_disk: bool = False, direct: bool | None = None) -> DiskOptimizer:
        """`params_on_disk`: the owned parameters go to files as well (ZeRO-3 shards);
        read them back with `read_param`. `direct`: O_DIRECT for full records (None:
        where the directory's file system takes it)."""
        grad_dtype = max(grad_dtypes, key=lambda d: d.itemsize, default=master_dtype)
        param_dtype = owned_params[0].dtype if params_on_disk and owned_params else None
        on_cpu = all(p.device.type == "cpu" for p in owned_params)
        disk = cls([p.numel() for p in owned_params], decay, master_dtype, grad_dtype,
                   Path(directory), budget_bytes, tag, param_dtype, not on_cpu, direct)
        disk._write_initial(owned_params)
        return disk

    def close(self) -> None:
        """Let go of this rank's lock on its files (done as well when the optimizer is
        collected, and by the kernel when the process ends)."""
        self._unlock()

    def read_param(self, b: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bucket `b`'s owned parameters, read from their file (params on disk)."""
        t = torch.empty(self.sizes[b], dtype=self.param_dtype)
        with open(self.param_paths[b], "rb") as f:
            _io(os.preadv, f.fileno(), self.param_paths[b], [t], 0, "reading")
        return t.to(device, non_blocking=True)

    # Files ---------------------------------------------------------------------------
    def _record(self, a: int, e: int) -> tuple[int, bool]:
        """Byte offset of the record of sub-group [a, e), and whether it is a full
        (aligned, O_DIRECT) one."""
        return len(STATES) * a * self.dtype.itemsize, e - a == self.subgroup and self.direct

    def _tasks(self, order: list[int]) -> list[tuple[int, int, int]]:
        return [(b, a, min(a + self.subgroup, self.sizes[b]))
                for b in order for a in range(0, self.sizes[b], self.subgroup)]

    def _transfer(self, fn, files: _Files, s: _Set, a: int, e: int, what: str) -> None:
        """One record between `s` and the file: one call of three buffers."""
        offset, aligned = self._record(a, e)
        _io(fn, files.fd(aligned), files.path, [t[:e - a] for t in s.states], offset, what)

    def _write_initial(self, owned_params: list[torch.Tensor]) -> None:
        """Both generations sized; generation 0 the parameters as master weights with
        zero moments."""
        s = self.sets[0]
        for b, param in enumerate(owned_params):
            size = len(STATES) * self.sizes[b] * self.dtype.itemsize
            for g in (0, 1):
                with open(self.paths[b][g], "wb") as f:
                    f.truncate(size)
            files = _Files(self.paths[b][0], os.O_WRONLY, self.direct)
            try:
                for _, a, e in self._tasks([b]):
                    s.states[0][:e - a].copy_(param.reshape(-1)[a:e])
                    s.states[1].zero_()
                    s.states[2].zero_()
                    self._transfer(os.pwritev, files, s, a, e, "writing")
            finally:
                files.close()
            if self.param_paths:
                with open(self.param_paths[b], "wb") as f:
                    value = param.detach().reshape(-1).cpu().contiguous()
                    _io(os.pwritev, f.fileno(), self.param_paths[b], [value], 0, "writing")

    # One step ------------------------------------------------------------------------
    def step(self, order: list[int], params: list[torch.Tensor], grads: list[torch.Tensor],
             step: int, lr: float, cfg: AdamWConfig) -> None:
        """AdamW on every sub-group in `order`'s bucket order; updated master values are
        copied into `params` (each bucket's owned slice, device or host)."""
        started = time.perf_counter()
        src, dst = self.generation, self.generation ^ 1
        readers = {b: _Files(self.paths[b][src], os.O_RDONLY, self.direct) for b in order}
        writers = {b: _Files(self.paths[b][dst], os.O_WRONLY, self.direct) for b in order}
        # Parameters on disk are overwritten in place: a failed step leaves some of them
        # updated (their optimizer states are not: resume from a checkpoint).
        pwriters = {b: os.open(self.param_paths[b], os.O_WRONLY) for b in order} \
            if self.param_paths else {}
        tasks = self._tasks(order)
        free: queue.Queue = queue.Queue()
        ready: queue.Queue = queue.Queue()
        written: queue.Queue = queue.Queue()
        for s in self.sets:
            free.put(s)
        errors: list[BaseException] = []

        def read_all() -> None:
            for task in tasks:
                s = free.get()
                if s is None:
                    return
                b, a, e = task
                try:
                    self._transfer(os.preadv, readers[b], s, a, e, "reading")
                except BaseException as exc:  # reported on the main thread
                    ready.put(exc)
                    return
                s.task = task
                ready.put(s)

        def write_all() -> None:
            while (s := written.get()) is not None:
                b, a, e = s.task
                try:
                    if not errors:
                        self._transfer(os.pwritev, writers[b], s, a, e, "writing")
                        if s.param is not None:
                            _io(os.pwritev, pwriters[b], self.param_paths[b],
                                [s.param[:e - a]], a * s.param.element_size(), "writing")
                except BaseException as exc:
                    errors.append(exc)
                free.put(s)

        reader = threading.Thread(target=read_all, daemon=True)
        writer = threading.Thread(target=write_all, daemon=True)
        reader.start()
        writer.start()
        try:
            for _ in tasks:
                s = ready.get()
                if isinstance(s, BaseException):
                    raise s
                if errors:
                    raise errors[0]
                b, a, e = s.task
                self.copies.append(("read", b, a))
                n = e - a
                master, exp_avg, exp_avg_sq = (t[:n] for t in s.states)
                grad = grads[b][a:e] if s.grad is None else s.grad[:n].copy_(grads[b][a:e])
                adamw_(master, grad, exp_avg, exp_avg_sq, step, lr, cfg,
                       _clip(self.decay[b], a, e), self.scratch)
                self.copies.append(("adam", b, a))
                if s.param is not None:
                    s.param[:n].copy_(master)
                else:
                    params[b][a:e].copy_(master)
                written.put(s)
                self.copies.append(("write", b, a))
        finally:
            written.put(None)
            writer.join()
            free.put(None)
            reader.join()
            for files in (*readers.values(), *writers.values()):
                files.close()
            for fd in pwriters.values():
                os.close(fd)
        if errors:
            raise errors[0]
        moved = len(STATES) * sum(self.sizes[b] for b in order) * self.dtype.itemsize
        self.bytes_read += moved
        self.bytes_written += moved
        self.generation = dst  # every sub-group is on disk: the new state is current
        self.seconds += time.perf_counter() - started

    def read_states(self, b: int) -> dict[str, torch.Tensor]:
        """Bucket `b`'s current master weights and moments, read whole (checkpoints)."""
        out = {name: torch.empty(self.sizes[b], dtype=self.dtype) for name in STATES}
        files = _Files(self.paths[b][self.generation], os.O_RDONLY, self.direct)
        s = self.sets[0]
        try:
            for _, a, e in self._tasks([b]):
                self._transfer(os.preadv, files, s, a, e, "reading")
                for name, t in zip(STATES, s.states):
                    out[name][a:e].copy_(t[:e - a])
        finally:
            files.close()
        return out

    def write_states(self, b: int, states: dict[str, torch.Tensor]) -> None:
        """Bucket `b`'s master weights and moments, whole (a checkpoint loaded), into
        the current generation's file."""
        files = _Files(self.paths[b][self.generation], os.O_WRONLY, self.direct)
        s = self.sets[0]
        try:
            for _, a, e in self._tasks([b]):
                for name, t in zip(STATES, s.states):
                    t[:e - a].copy_(states[name].reshape(-1)[a:e])
                self._transfer(os.pwritev, files, s, a, e, "writing")
        finally:
            files.close()

    def write_param(self, b: int, value: torch.Tensor) -> None:
        """Bucket `b`'s owned parameters into their file (params on disk)."""
        value = value.detach().reshape(-1).to("cpu", self.param_dtype).contiguous()
        with open(self.param_paths[b], "r+b") as f:
            _io(os.pwritev, f.fileno(), self.param_paths[b], [value], 0, "writing")

    def buffer_bytes(self) -> int:
        """Host memory the engine holds: its buffer sets (with their alignment slack)
        and scratch."""
        return (self.block.nbytes + ALIGN
                + sum(t.nbytes for s in self.sets for t in (s.grad, s.param)
                      if t is not None)
                + self.scratch.nbytes)

    def disk_bytes(self) -> int:
        files = [p for pair in self.paths for p in pair] + self.param_paths
        return sum(p.stat().st_size for p in files if p.exists())


def _clip(ranges: list[tuple[int, int]], a: int, e: int) -> list[tuple[int, int]]:
    """Decay ranges of a slice, cut to [a, e) and made relative to a."""
    return [(max(lo, a) - a, min(hi, e) - a) for lo, hi in ranges if lo < e and hi > a]
