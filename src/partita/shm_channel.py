"""Point-to-point transfers through shared memory, for a gloo group whose ranks share a
host: the pipeline's activations and gradients, ring attention's keys and values.

Over gloo a receive completes about 0.5 ms after the later of its send and the
receiver's wait (loopback TCP, docs/benchmarks.md "Pipeline parallelism"), and both
cores spend time copying through the kernel. Ranks on one host instead share a ring of
slots in /dev/shm per ordered pair of members that transfer (the caller names the
pairs): the sender copies a tensor into the ring's next slots and raises a counter, the
receiver copies it out and raises another. Transfers of a pair match by order, as over
gloo (the callers post them so: `pipeline.p2p.check_transfer_order` proves it for a
schedule), so a ring in order is all a pair needs; a tensor larger than a slot takes
several.

Sends never block the runner. One goes in at once when its ring has room for all of it
and nothing of that pair is queued before it; otherwise the pair's helper thread puts it
in as the receiver frees slots. A receive is a buffer queued on its pair; waiting on one
first copies out every receive queued before it on that pair. Every wait is bounded by
the caller's timeout and ends early when the peer's process has ended
(`shm_share.wait_while`). Setup is one collective over the group (`shm_share.share`);
where it fails the caller keeps gloo.
"""

from __future__ import annotations

import ctypes
import datetime
import queue
import threading
import weakref
from collections import deque

import torch

from partita import shm_os, shm_share
from partita.comm import GroupComm

# Eight slots of 256 KiB per ring, 2 MiB a pair: a 1F1B pair holds at most p activations
# in flight, the tiny model's are 64 KiB and a larger one streams through. A group with
# many pairs (ring attention at c = 8 has 56) gives each fewer slots, down to 2, so that
# its rings take at most about what a group's collective arena takes.
SLOT_BYTES = 256 * 1024
SLOTS = 8
BUDGET_BYTES = 32 * 1024 * 1024
_LINE = 64  # each counter on its own cache line
_MASK = 0xFFFFFFFF


def _header_bytes(n_pairs: int) -> int:
    # The file's first line holds the token `shm_share` checks; then two lines per pair.
    return shm_share.whole_pages(_LINE * (1 + 2 * n_pairs))


def slots_per_ring(n_pairs: int) -> int:
    """A power of two (a ring's counters wrap at 2^32), 2 to SLOTS."""
    fit = max(2, min(SLOTS, BUDGET_BYTES // (max(n_pairs, 1) * SLOT_BYTES)))
    return 1 << (fit.bit_length() - 1)


def arena_bytes(n_pairs: int) -> int:
    return _header_bytes(n_pairs) + n_pairs * slots_per_ring(n_pairs) * SLOT_BYTES


def chunks(nbytes: int) -> int:
    """Slots a tensor of `nbytes` takes (an empty one takes one, so that it still
    counts as a transfer)."""
    return max(1, -(-nbytes // SLOT_BYTES))


class Channels:
    """This rank's ends of the rings of `pairs` (member indices) in a shared file."""

    def __init__(self, shared: shm_share.Shared, comm: GroupComm,
                 pairs: list[tuple[int, int]], timeout_s: float, what: str) -> None:
        self._shared = shared  # keeps the mapping alive
        self.comm = comm
        index, ranks = comm.index, comm.ranks
        slots = slots_per_ring(len(pairs))
        header = _header_bytes(len(pairs))
        base = shared.arena.data_ptr() + _LINE
        self.outboxes: dict[int, _Outbox] = {}
        self.inboxes: dict[int, _Inbox] = {}
        for k, (src, dst) in enumerate(pairs):
            at = header + k * slots * SLOT_BYTES
            ring = _Ring(base + 2 * _LINE * k, base + (2 * k + 1) * _LINE,
                         [shared.arena[at + i * SLOT_BYTES:at + (i + 1) * SLOT_BYTES]
                          for i in range(slots)], timeout_s)
            if src == index:
                who = f"{what} rank {dst} (global rank {ranks[dst]})"
                self.outboxes[dst] = _Outbox(ring, shared.peers[dst], who)
            elif dst == index:
                who = f"{what} rank {src} (global rank {ranks[src]})"
                self.inboxes[src] = _Inbox(ring, shared.peers[src], who)

    def send(self, peer: int, tensor: torch.Tensor):
        """Start sending `tensor` (kept alive by the caller until the handle completes)
        to member `peer`; counted as the group's gloo sends are."""
        self.comm.count_send(tensor)
        return self.outboxes[peer].send(tensor)

    def recv(self, peer: int, tensor: torch.Tensor):
        """Queue `tensor` (contiguous) to receive the next transfer from `peer`."""
        return self.inboxes[peer].recv(tensor)


def open_channels(comm: GroupComm, pairs: list[tuple[int, int]], timeout_s: float,
                  what: str = "pipeline") -> Channels | None:
    """The rings of `pairs` (member indices of `comm`), set up collectively over its
    group; None where its transfers stay on gloo (`GroupComm.shared_transfers`) or, on
    every member, where a shared file cannot be had. `what` names the group in messages
    ("pipeline rank 1 ...")."""
    if not (pairs and comm.shared_transfers):
        return None
    shared = shm_share.share(comm.group, comm.ranks, comm.index, arena_bytes(len(pairs)),
                             f"{what} transfers")
    return None if shared is None else Channels(shared, comm, pairs, timeout_s, what)


class _Ring:
    """One pair's ring: a count of slots written (`produced`, by the sender) and of slots
    read (`consumed`, by the receiver), each a 32-bit word in shared memory."""

    def __init__(self, produced: int, consumed: int, slots: list[torch.Tensor],
                 timeout_s: float) -> None:
        self.produced = ctypes.c_uint32.from_address(produced)
        self.consumed = ctypes.c_uint32.from_address(consumed)
        self.produced_at, self.consumed_at = produced, consumed
        self.slots, self.timeout_s = slots, timeout_s
        self.count = 0  # slots this end has moved (the sender's produced, the receiver's consumed)


class _Handle:
    """A transfer's handle: `wait(timeout)` as a gloo work's, for `p2p.Transport`."""

    def __init__(self, done: bool = False) -> None:
        self.event = threading.Event()
        if done:
            self.event.set()
        self.exc: BaseException | None = None

    def is_completed(self) -> bool:
        return self.event.is_set() and self.exc is None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        # The transfer's own waits are bounded by the caller's timeout already.
        self.event.wait()
        if self.exc is not None:
            raise self.exc
        return True


class _Outbox:
    """The sending end of one ring, with a helper thread for sends that must wait for
    room (started on the first such send)."""

    def __init__(self, ring: _Ring, peer: tuple[int, int] | None, who: str) -> None:
        self.ring, self.peer, self.who = ring, peer, who
        self._lock = threading.Lock()
        self._pending = 0
        self._queue: queue.SimpleQueue | None = None
        self.error: BaseException | None = None

    def send(self, tensor: torch.Tensor) -> _Handle:
        data = tensor.reshape(-1).view(torch.uint8)
        ring = self.ring
        with self._lock:
            room = len(ring.slots) - ((ring.count - ring.consumed.value) & _MASK)
            if self._pending == 0 and self.error is None and chunks(data.numel()) <= room:
                self._put(data)
                return _Handle(done=True)
            handle = _Handle()
            self._pending += 1
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(self._queue, weakref.ref(self)),
                                 daemon=True, name="partita-shm-send").start()
            self._queue.put((data, handle))
        return handle

    def _put(self, data: torch.Tensor) -> None:
        """Copy `data` into the ring slot by slot, waiting for room where it is full."""
        ring, n = self.ring, data.numel()
        for o in range(0, max(n, 1), SLOT_BYTES):
            full = (ring.count - len(ring.slots)) & _MASK
            if ring.consumed.value == full:
                shm_share.wait_while(ring.consumed_at, full, ring.timeout_s, self.peer,
                                     "shared-memory send", self.who)
            c = min(SLOT_BYTES, n - o)
            ring.slots[ring.count % len(ring.slots)][:c].copy_(data[o:o + c])
            ring.count = (ring.count + 1) & _MASK
            ring.produced.value = ring.count  # after the bytes: x86 keeps stores in order
            shm_os.futex_wake(ring.produced_at)

    def __del__(self) -> None:
        if self._queue is not None:
            self._queue.put(None)


def _serve(jobs: queue.SimpleQueue, owner: weakref.ref) -> None:
    """One outbox's queued sends, in order, until the outbox is collected."""
    while (job := jobs.get()) is not None:
        data, handle = job
        box = owner()
        if box is None:
            return
        try:
            _transfer(box, box._put, data, handle)
        finally:
            with box._lock:
                box._pending -= 1
        del box, data, handle, job


def _transfer(end: _Outbox | _Inbox, move, data: torch.Tensor, handle: _Handle) -> None:
    """`move(data)` on one end of a ring, completing `handle`. A failure leaves the ring
    out of step, so the end keeps it and every later transfer through it fails at once."""
    try:
        if end.error is not None:
            raise RuntimeError(f"an earlier transfer with {end.who} failed: {end.error}")
        move(data)
    except BaseException as exc:
        end.error = end.error or exc
        handle.exc = exc
    finally:
        handle.event.set()


class _Inbox:
    """The receiving end of one ring: receives queue in posting order, and waiting on one
    completes it and every receive before it."""

    def __init__(self, ring: _Ring, peer: tuple[int, int] | None, who: str) -> None:
        self.ring, self.peer, self.who = ring, peer, who
        self._posted: deque[tuple[torch.Tensor, _Handle]] = deque()
        self.error: BaseException | None = None

    def recv(self, tensor: torch.Tensor) -> _Receive:
        if not tensor.is_contiguous():  # its bytes would be copied into a temporary
            raise ValueError("a receive buffer must be contiguous")
        handle = _Receive(self)
        self._posted.append((tensor.reshape(-1).view(torch.uint8), handle))
        return handle

    def complete(self, handle: _Receive) -> None:
        while not handle.event.is_set():
            data, first = self._posted.popleft()
            _transfer(self, self._take, data, first)

    def _take(self, data: torch.Tensor) -> None:
        ring, n = self.ring, data.numel()
        for o in range(0, max(n, 1), SLOT_BYTES):
            if ring.produced.value == ring.count:
                shm_share.wait_while(ring.produced_at, ring.count, ring.timeout_s,
                                     self.peer, "shared-memory receive", self.who)
            c = min(SLOT_BYTES, n - o)
            data[o:o + c].copy_(ring.slots[ring.count % len(ring.slots)][:c])
            ring.count = (ring.count + 1) & _MASK
            ring.consumed.value = ring.count  # after the bytes are out: the slot is free
            shm_os.futex_wake(ring.consumed_at)


class _Receive(_Handle):
    """A queued receive: waiting on it copies it (and those queued before it) out."""

    def __init__(self, inbox: _Inbox) -> None:
        super().__init__()
        self.inbox = inbox

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.inbox.complete(self)
        return super().wait(timeout)
