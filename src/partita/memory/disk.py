"""ZeRO-Infinity: master weights and Adam moments (and ZeRO-3 parameter shards) in files,
updated in sub-groups through a bounded set of host buffers.

    disk = DiskOptimizer.create(owned_params, grad_dtypes, decay, master_dtype, device,
                                directory, budget_bytes, tag="rank0")
    disk.step(order, owned_params, owned_grads, step, lr, cfg)

Each bucket's owned slice is cut into sub-groups of `subgroup` elements. A step walks
them in the order the next forward needs the buckets, through `SETS` buffer sets (one
being read ahead, one being updated, one being written back); a set holds a
sub-group's master, both moments and its gradient, so the engine's buffers never take
more than the budget. A reader thread prefetches the next sub-group's states while the
CPU updates the current one; a writer thread writes updated ones back. Reads and writes
are `os.preadv` / `os.pwritev` straight into the tensors' memory (no copies; the GIL is
released while they run).

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
from dataclasses import dataclass
from pathlib import Path

import torch

from partita.errors import PartitaError
from partita.optim import AdamWConfig, adamw_, adamw_scratch

SETS = 3  # buffer sets in flight: read ahead, update, write back
MIN_SUBGROUP = 4096  # elements: smaller reads cost more in calls than they move
STATES = ("master", "exp_avg", "exp_avg_sq")


def subgroup_elements(budget_bytes: int, master_dtype: torch.dtype,
                      grad_dtype: torch.dtype, param_dtype: torch.dtype | None = None) -> int:
    """The largest sub-group whose SETS buffer sets (and, when gradients are cast to the
    master dtype, the cast's scratch) fit in `budget_bytes`; raises when not even
    MIN_SUBGROUP elements fit."""
    per = SETS * (3 * master_dtype.itemsize + grad_dtype.itemsize
                  + (param_dtype.itemsize if param_dtype is not None else 0))
    if grad_dtype != master_dtype:
        per += master_dtype.itemsize  # adamw_'s cast scratch, at most a sub-group
    n = int(budget_bytes // per)
    if n < MIN_SUBGROUP:
        raise PartitaError(
            f"parallel.host_memory_budget_gb={budget_bytes / 1e9:g} is smaller than one "
            f"disk-offload sub-group: {SETS} buffer sets of {MIN_SUBGROUP} elements need "
            f"{per * MIN_SUBGROUP} bytes. Raise the budget.")
    return n


def disk_bytes_needed(elements: int, master_dtype: torch.dtype) -> int:
    """Bytes the files of `elements` owned elements take (two generations of three
    states)."""
    return 2 * len(STATES) * elements * master_dtype.itemsize


def check_offload_dir(directory: str, bytes_needed: int) -> None:
    """Before training: the directory exists, is writable and has room for the files."""
    path = Path(directory) if directory else None
    if path is None or not path.is_dir():
        raise PartitaError(
            f"parallel.offload_dir={directory!r} is not an existing directory; disk offload "
            f"writes the optimizer state there ({bytes_needed:,} bytes). Create it, or set "
            "parallel.offload to a mode without disk.")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PartitaError(f"parallel.offload_dir={directory!r} is not writable; disk "
                           f"offload needs to write {bytes_needed:,} bytes there.")
    free = shutil.disk_usage(path).free
    if free < bytes_needed:
        raise PartitaError(
            f"parallel.offload_dir={directory!r} has {free:,} bytes free, but disk offload "
            f"needs {bytes_needed:,} (master weights and two Adam moments, two generations). "
            "Free space or choose another directory.")


@dataclass
class _Set:
    """Host buffers for one sub-group: its three states and its gradient."""

    states: list[torch.Tensor]
    grad: torch.Tensor
    param: torch.Tensor | None = None  # the updated parameters, when they live on disk
    task: tuple[int, int, int] | None = None  # (bucket, start, stop)


def _io(fn, fd: int, path: Path, tensor: torch.Tensor, offset: int, what: str) -> None:
    view = memoryview(tensor.view(torch.uint8).numpy())  # any dtype, bf16 included
    try:
        done = fn(fd, [view], offset)
    except OSError as exc:
        raise PartitaError(f"disk offload: {what} {path} at byte {offset} failed: {exc}. "
                           "The optimizer state of the previous step is intact on disk.") from exc
    if done != view.nbytes:
        raise PartitaError(f"disk offload: {what} {path} at byte {offset} moved {done} of "
                           f"{view.nbytes} bytes (file truncated?). The optimizer state of "
                           "the previous step is intact on disk.")


class DiskOptimizer:
    """AdamW states of each bucket's owned slice in files, stepped in sub-groups."""

    def __init__(self, sizes: list[int], decay: list[list[tuple[int, int]]],
                 master_dtype: torch.dtype, grad_dtype: torch.dtype, directory: Path,
                 budget_bytes: int, tag: str, param_dtype: torch.dtype | None = None) -> None:
        self.sizes, self.decay, self.dtype = sizes, decay, master_dtype
        self.param_dtype = param_dtype  # set: the parameter shards live in files too
        self.subgroup = subgroup_elements(budget_bytes, master_dtype, grad_dtype, param_dtype)
        self.subgroup = min(self.subgroup, max(sizes, default=1))
        self.sets = [_Set([torch.empty(self.subgroup, dtype=master_dtype) for _ in STATES],
                          torch.empty(self.subgroup, dtype=grad_dtype),
                          None if param_dtype is None else
                          torch.empty(self.subgroup, dtype=param_dtype))
                     for _ in range(SETS)]
        self.scratch = adamw_scratch(self.subgroup if grad_dtype != master_dtype else 0,
                                     master_dtype, torch.device("cpu"))
        self.directory = Path(directory)
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
               params_on_disk: bool = False) -> DiskOptimizer:
        """`params_on_disk`: the owned parameters go to files as well (ZeRO-3 shards);
        read them back with `read_param`."""
        grad_dtype = max(grad_dtypes, key=lambda d: d.itemsize, default=master_dtype)
        param_dtype = owned_params[0].dtype if params_on_disk and owned_params else None
        disk = cls([p.numel() for p in owned_params], decay, master_dtype, grad_dtype,
                   Path(directory), budget_bytes, tag, param_dtype)
        disk._write_initial(owned_params)
        return disk

    def read_param(self, b: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bucket `b`'s owned parameters, read from their file (params on disk)."""
        t = torch.empty(self.sizes[b], dtype=self.param_dtype)
        with open(self.param_paths[b], "rb") as f:
            _io(os.preadv, f.fileno(), self.param_paths[b], t, 0, "reading")
        return t.to(device, non_blocking=True)

    # Files ---------------------------------------------------------------------------
    def _offset(self, b: int, state: int, start: int) -> int:
        return (state * self.sizes[b] + start) * self.dtype.itemsize

    def _tasks(self, order: list[int]) -> list[tuple[int, int, int]]:
        return [(b, a, min(a + self.subgroup, self.sizes[b]))
                for b in order for a in range(0, self.sizes[b], self.subgroup)]

    def _write_initial(self, owned_params: list[torch.Tensor]) -> None:
        """Generation 0: the parameters as master weights, zero moments."""
        buf = self.sets[0].states[0]
        for b, param in enumerate(owned_params):
            with open(self.paths[b][0], "wb") as f:
                f.truncate(self._offset(b, len(STATES), 0))
                fd = f.fileno()
                for _, a, e in self._tasks([b]):
                    n = e - a
                    buf[:n].copy_(param.reshape(-1)[a:e])
                    _io(os.pwritev, fd, self.paths[b][0], buf[:n], self._offset(b, 0, a),
                        "writing")
            self.paths[b][1].touch()
            if self.param_paths:
                with open(self.param_paths[b], "wb") as f:
                    value = param.detach().reshape(-1).cpu().contiguous()
                    _io(os.pwritev, f.fileno(), self.param_paths[b], value, 0, "writing")

    # One step ------------------------------------------------------------------------
    def step(self, order: list[int], params: list[torch.Tensor], grads: list[torch.Tensor],
             step: int, lr: float, cfg: AdamWConfig) -> None:
        """AdamW on every sub-group in `order`'s bucket order; updated master values are
        copied into `params` (each bucket's owned slice, device or host)."""
        started = time.perf_counter()
        src, dst = self.generation, self.generation ^ 1
        readers = {b: os.open(self.paths[b][src], os.O_RDONLY) for b in order}
        writers = {b: os.open(self.paths[b][dst], os.O_WRONLY) for b in order}
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
                    for k, t in enumerate(s.states):
                        _io(os.preadv, readers[b], self.paths[b][src], t[:e - a],
                            self._offset(b, k, a), "reading")
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
                        for k, t in enumerate(s.states):
                            _io(os.pwritev, writers[b], self.paths[b][dst], t[:e - a],
                                self._offset(b, k, a), "writing")
                        if s.param is not None:
                            _io(os.pwritev, pwriters[b], self.param_paths[b], s.param[:e - a],
                                a * s.param.element_size(), "writing")
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
                s.grad[:n].copy_(grads[b][a:e])
                adamw_(master, s.grad[:n], exp_avg, exp_avg_sq, step, lr, cfg,
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
            for fd in (*readers.values(), *writers.values(), *pwriters.values()):
                os.close(fd)
        if errors:
            raise errors[0]
        moved = 2 * len(STATES) * sum(self.sizes[b] for b in order) * self.dtype.itemsize
        self.bytes_read += moved // 2
        self.bytes_written += moved // 2
        self.generation = dst  # every sub-group is on disk: the new state is current
        self.seconds += time.perf_counter() - started

    def read_states(self, b: int) -> dict[str, torch.Tensor]:
        """Bucket `b`'s current master weights and moments, read whole (checkpoints)."""
        out = {}
        with open(self.paths[b][self.generation], "rb") as f:
            for k, name in enumerate(STATES):
                t = torch.empty(self.sizes[b], dtype=self.dtype)
                _io(os.preadv, f.fileno(), self.paths[b][self.generation], t,
                    self._offset(b, k, 0), "reading")
                out[name] = t
        return out

    def buffer_bytes(self) -> int:
        """Host memory the engine holds: its buffer sets and scratch."""
        return (sum(t.nbytes for s in self.sets for t in (*s.states, s.grad)
                    if t is not None)
                + sum(s.param.nbytes for s in self.sets if s.param is not None)
                + self.scratch.nbytes)

    def disk_bytes(self) -> int:
        files = [p for pair in self.paths for p in pair] + self.param_paths
        return sum(p.stat().st_size for p in files if p.exists())


def _clip(ranges: list[tuple[int, int]], a: int, e: int) -> list[tuple[int, int]]:
    """Decay ranges of a slice, cut to [a, e) and made relative to a."""
    return [(max(lo, a) - a, min(hi, e) - a) for lo, hi in ranges if lo < e and hi > a]
