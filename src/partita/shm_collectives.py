"""Flat all-gathers, reduce-scatters, all-reduces and all-to-alls through shared memory,
for gloo groups on one host.

gloo moves every byte through TCP on the loopback interface: two ranks broadcasting to
each other move 0.7-1.5 GiB/s per direction while both cores copy through the kernel.
When every member of a group runs on the same host they can instead share an arena in
/dev/shm: an all-gather is one copy of the shard in and one copy of the output out, a
reduce-scatter one copy of the input in and a sum of the members' pieces out, an
all-reduce a reduce-scatter whose sums every member copies out, an all-to-all each
member's rows for each other member copied in and out, at memory speed (figures in
docs/benchmarks.md).

Setup is lazy and collective: the first flat collective of a group maps one file in
/dev/shm on every member (`partita.shm_share`, which says how it checks that the members
share it and what happens where they do not: every member keeps the gloo forms,
`partita.gloo_collectives`).

The arena holds a header of flags (one 32-bit generation counter per member, each on its
own cache line) and two buffers, used by turns. A large tensor goes through in chunks of
one buffer each; after writing a chunk a member raises its flag and sleeps on the
others' with futex(2), bounded by the group's timeout. Two buffers make that one barrier
per chunk enough: a member about to write a buffer has passed the barrier after the last
read of it by every member. Sums run in rank order, as the gloo forms sum, so results
are bitwise the same on either transport.

Asynchronous calls run in issue order on one thread per group (copies, sums and futex
waits release the GIL), so compute overlaps them as it overlaps gloo's transfers.
Linux on x86-64 only (futex and the ordering of plain stores); elsewhere gloo is used.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import weakref

import torch
import torch.distributed as dist

from partita import shm_os, shm_share
from partita.errors import PartitaError
from partita.gloo_collectives import _sum_in_rank_order

# Collectives on fewer bytes keep gloo's forms. By default none do: a 64 KiB all-reduce
# took 0.14 ms through the arena against gloo's 1.5 at 2 ranks (0.33 / 5.1 at 4), and
# whole steps of the tiny model ran 5-7% faster with every collective through it, tp=2
# with sequence parallelism 1.47x, also with two busy processes sharing the cores
# (docs/benchmarks.md, "Every collective through the arena"). The environment variable
# sets a floor for a host whose balance differs.
MIN_BYTES = 0
ENV_MIN_BYTES = "PARTITA_SHM_MIN_BYTES"
# Bytes of one buffer: each member's chunk (all-gather), or all members' pieces of every
# destination (reduce-scatter). Two buffers per arena: 32 MiB in all per group.
BUFFER_BYTES = 16 * 1024 * 1024
_LINE = 64  # one flag per cache line
_MASK = 0xFFFFFFFF


def _header_bytes(size: int) -> int:
    return shm_share.whole_pages(_LINE * (size + 1))


def _buffer_bytes(buffer_bytes: int, size: int) -> int:
    return buffer_bytes // (_LINE * size) * (_LINE * size)


def arena_bytes(size: int, buffer_bytes: int = BUFFER_BYTES) -> int:
    """Bytes of /dev/shm the arena of a group of `size` members takes (once per group)."""
    return _header_bytes(size) + 2 * _buffer_bytes(buffer_bytes, size)


def floor_bytes() -> int:
    """The fewest bytes a flat collective goes through the arena with: MIN_BYTES, or
    PARTITA_SHM_MIN_BYTES where set (the same on every process of a host)."""
    raw = os.environ.get(ENV_MIN_BYTES, "").strip()
    if not raw:
        return MIN_BYTES
    if not raw.isdecimal():
        raise PartitaError(
            f"{ENV_MIN_BYTES}={raw!r} is not a byte count: give a whole number, 0 or more "
            f"(0 sends every flat collective through shared memory), or unset it for "
            f"the default {MIN_BYTES}")
    return int(raw)


class ShmGroup:
    """The shared-memory transport of one process group (`ranks`: its members' global
    ranks, `index`: this rank's position). Nothing happens until `ready()`, which every
    member must call at the same point of the group's collective sequence. Collectives
    on fewer than `min_bytes` (default `floor_bytes()`) keep gloo's forms (`carries`,
    which `GroupComm` asks)."""

    def __init__(self, group: dist.ProcessGroup, ranks: list[int], index: int,
                 buffer_bytes: int = BUFFER_BYTES, threaded: bool = True,
                 min_bytes: int | None = None) -> None:
        self.group, self.ranks, self.index = group, ranks, index
        self.min_bytes = floor_bytes() if min_bytes is None else min_bytes
        self.size = len(ranks)
        self.buffer_bytes = _buffer_bytes(buffer_bytes, self.size)
        self.threaded = threaded
        self.state: bool | None = None  # None: not yet set up; False: gloo it is
        self.steps = 0  # chunks moved, the same count on every member
        self.calls = 0  # collectives run through the arena (tests check the path)
        self.error: BaseException | None = None
        self.path: str | None = None
        self._queue: queue.SimpleQueue | None = None
        self._pending = 0
        self._lock = threading.Lock()

    def carries(self, nbytes: int) -> bool:
        """Whether a flat collective on a buffer of `nbytes` goes through the arena:
        from `min_bytes` on (every size by default, `MIN_BYTES`)."""
        return nbytes >= self.min_bytes

    # Setup -----------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether the arena is in use; sets it up on the first call (collective)."""
        if self.state is None:
            self.state = self._setup()
        return self.state

    def _setup(self) -> bool:
        header = _header_bytes(self.size)
        shared = shm_share.share(self.group, self.ranks, self.index,
                                 arena_bytes(self.size, self.buffer_bytes), "collectives")
        if shared is None:
            return False
        self._shared, self.path = shared, shared.path
        self.timeout_s, self._peers = shared.timeout_s, shared.peers
        self.arena = shared.arena
        base = self.arena.data_ptr()
        self._flags = [base + _LINE * (1 + j) for j in range(self.size)]
        self._buffers = [self.arena[header + b * self.buffer_bytes:
                                    header + (b + 1) * self.buffer_bytes] for b in (0, 1)]
        return True

    # Issue -----------------------------------------------------------------------------
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool):
        """Every member's `shard` into `output`, in rank order (bytes copied as they are)."""
        return self._issue(self._all_gather, (output, shard), async_op)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, pairwise: bool,
                       async_op: bool):
        """Sum `full` over members into this member's slice `shard`. `pairwise`: sum as
        the gloo pairwise form does (one add per member), else as its all-to-all form
        (one `torch.sum` over the members' pieces): bitwise the gloo form's result."""
        return self._issue(self._reduce_scatter, (shard, full, pairwise), async_op)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool):
        """Sum contiguous `tensor` over members, in place; every member ends with the
        same bytes."""
        return self._issue(self._all_reduce, (tensor,), async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_splits: list[int], input_splits: list[int], row_bytes: int):
        """Rows input_splits[k] of `input` to member k, output_splits[j] rows from member
        j into `output`, in member order (bytes copied as they are; synchronous)."""
        return self._issue(self._all_to_all,
                           (output, input, output_splits, input_splits, row_bytes), False)

    def _issue(self, fn, args: tuple, async_op: bool):
        work = _Work()
        with self._lock:
            inline = not (self.threaded and async_op) and self._pending == 0
            if not inline:
                self._pending += 1
                if self._queue is None:
                    self._queue = queue.SimpleQueue()
                    threading.Thread(target=_serve, args=(self._queue, weakref.ref(self)),
                                     daemon=True, name="partita-shm").start()
                self._queue.put((fn, args, work))
        if inline:
            self._run(fn, args, work)
        if async_op:
            return work
        work.wait()
        return None

    def _run(self, fn, args: tuple, work: _Work) -> None:
        try:
            if self.error is not None:  # a failed collective leaves the arena out of step
                raise RuntimeError("an earlier shared-memory collective of this group "
                                   f"failed: {self.error}")
            fn(*args)
            self.calls += 1
        except BaseException as exc:
            self.error = self.error or exc
            work.exc = exc
        finally:
            work.event.set()

    def __del__(self) -> None:
        if self._queue is not None:
            self._queue.put(None)

    # The collectives proper -------------------------------------------------------------
    def _all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        out = output.view(-1).view(torch.uint8)
        mine = shard.reshape(-1).view(torch.uint8)
        n, size, me = mine.numel(), self.size, self.index
        own = out[me * n:(me + 1) * n]
        if own.data_ptr() != mine.data_ptr():
            own.copy_(mine)
        chunk = self.buffer_bytes // size
        for o in range(0, n, chunk):
            c = min(chunk, n - o)
            buf = self._next_buffer()
            buf[me * chunk:me * chunk + c].copy_(mine[o:o + c])
            self._barrier()
            for j in range(size):
                if j != me:
                    out[j * n + o:j * n + o + c].copy_(buf[j * chunk:j * chunk + c])

    def _reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor,
                        pairwise: bool) -> None:
        flat, out = full.view(-1), shard.view(-1)
        size, me = self.size, self.index
        n = flat.numel() // size
        chunk = self.buffer_bytes // (size * size * full.element_size())
        for o in range(0, n, chunk):
            c = min(chunk, n - o)
            # Destination-major: destination k's pieces lie together, member j's in row j,
            # the layout of the received block of the gloo all-to-all form.
            buf = self._next_buffer().view(full.dtype)[:size * size * c].view(size, size, c)
            for k in range(size):
                buf[k, me].copy_(flat[k * n + o:k * n + o + c])
            self._barrier()
            if pairwise:
                _sum_in_rank_order(list(buf[me].unbind(0)), out[o:o + c])
            else:
                torch.sum(buf[me], dim=0, out=out[o:o + c])

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        # Per chunk: every member writes its copy into its row of one buffer; member k
        # sums the k-th slice of the columns over the rows into the other buffer; all
        # copy the sums out. Each element is summed once, by one member, so the members
        # agree bitwise (the order is torch.sum's over the rows, not gloo's ring's).
        flat = tensor.view(-1)
        size, me = self.size, self.index
        n = flat.numel()
        chunk = self.buffer_bytes // (size * flat.element_size())
        for o in range(0, n, chunk):
            c = min(chunk, n - o)
            rows = self._next_buffer().view(flat.dtype)[:size * c].view(size, c)
            rows[me].copy_(flat[o:o + c])
            self._barrier()
            lo, hi = me * c // size, (me + 1) * c // size
            sums = self._next_buffer().view(flat.dtype)[:c]
            torch.sum(rows[:, lo:hi], dim=0, out=sums[lo:hi])
            self._barrier()
            flat[o:o + c].copy_(sums)

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                    output_splits: list[int], input_splits: list[int],
                    row_bytes: int) -> None:
        # The members first publish how many bytes each sends to each (one barrier):
        # every one then knows how many rounds the largest pair needs. Each round moves
        # up to a slot of every pair's bytes, slot (j, k) holding j's bytes for k.
        src, dst = input.reshape(-1).view(torch.uint8), output.reshape(-1).view(torch.uint8)
        size, me = self.size, self.index
        sizes = self._next_buffer()[:8 * size * size].view(torch.int64).view(size, size)
        sizes[me].copy_(torch.tensor(input_splits, dtype=torch.int64) * row_bytes)
        self._barrier()
        sent = sizes.tolist()
        if [sent[j][me] for j in range(size)] != [n * row_bytes for n in output_splits]:
            raise RuntimeError(f"all-to-all: member {me} expects "
                               f"{[n * row_bytes for n in output_splits]} bytes from the "
                               f"members, which send {[sent[j][me] for j in range(size)]}")
        send_at = [sum(input_splits[:k]) * row_bytes for k in range(size)]
        recv_at = [sum(output_splits[:j]) * row_bytes for j in range(size)]
        mine = sent[me][me]  # its own rows never leave it
        dst[recv_at[me]:recv_at[me] + mine].copy_(src[send_at[me]:send_at[me] + mine])
        slot = self.buffer_bytes // (size * size)
        most = max(sent[j][k] for j in range(size) for k in range(size) if j != k)
        for o in range(0, most, slot):
            buf = self._next_buffer()
            for k in range(size):
                if k != me and (c := min(slot, sent[me][k] - o)) > 0:
                    at = (me * size + k) * slot
                    buf[at:at + c].copy_(src[send_at[k] + o:send_at[k] + o + c])
            self._barrier()
            for j in range(size):
                if j != me and (c := min(slot, sent[j][me] - o)) > 0:
                    at = (j * size + me) * slot
                    dst[recv_at[j] + o:recv_at[j] + o + c].copy_(buf[at:at + c])

    def _next_buffer(self) -> torch.Tensor:
        buf = self._buffers[self.steps % 2]
        self.steps += 1
        return buf

    def _barrier(self) -> None:
        """Raise this member's generation, wake the sleepers, wait for every other
        member's. Members differ by at most one generation, so a flag still holding the
        previous one is a member not yet here."""
        gen = self.steps & _MASK
        me = self._flags[self.index]
        ctypes.c_uint32.from_address(me).value = gen
        shm_os.futex_wake(me)
        previous = (gen - 1) & _MASK
        for j, addr in enumerate(self._flags):
            if j != self.index:
                shm_share.wait_while(addr, previous, self.timeout_s, self._peers[j],
                                     "shared-memory collective",
                                     f"peer rank {self.ranks[j]} of group {self.ranks}")


class _Work:
    """Handle of a shared-memory collective: `wait()` returns once it is done."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.exc: BaseException | None = None

    def wait(self) -> bool:
        self.event.wait()
        if self.exc is not None:
            raise self.exc
        return True

    def is_completed(self) -> bool:
        return self.event.is_set()


def _serve(jobs: queue.SimpleQueue, owner: weakref.ref) -> None:
    """One group's collectives, in issue order, until its ShmGroup is collected."""
    while (job := jobs.get()) is not None:
        fn, args, work = job
        group = owner()
        if group is None:
            return
        group._run(fn, args, work)
        with group._lock:
            group._pending -= 1
        del group, fn, args, work, job
