"""Flat all-gathers and reduce-scatters on gloo, in forms faster than gloo's own.

`partita.comm.GroupComm` counts the bytes and hands gloo groups' flat collectives here.
gloo's `reduce_scatter_tensor` costs as much as a full all-reduce, and its all-gather
stages the output in a buffer of its own and walks the ring step by step. The forms
below send the same (n-1)/n * S per rank as a ring, in less time (figures in
docs/zero.md):

* small (reduce-scatter slices under 4 MiB, all-gather shards under 512 KiB): one
  all-to-all each, whose single message wins at that size;
* large: a reduce-scatter is one exchange per pair of members (each sends every other
  the slice it owns and sums what it receives), an all-gather one broadcast per member
  straight into its slot of the output.

Sums run in rank order, so every rank's result is deterministic. Each call takes the
group, the members' global ranks and this rank's index among them; with `async_op`
it returns a handle whose `wait()` leaves the result in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# All-gathers whose shard is at least this large run as one broadcast per member: the
# crossover measured at 2 and 4 ranks lies between 1/4 and 1 MiB.
BROADCAST_GATHER_BYTES = 512 * 1024
# Reduce-scatters whose slices are at least this large run as pairwise exchanges:
# measured at 2 and 4 ranks they win from 4 MiB per slice on, and are level or behind
# between a quarter of a MiB and 2 MiB.
PAIRWISE_REDUCE_BYTES = 4 * 1024 * 1024
# The pairwise reduce-scatter's sends and receives carry their own tag: a group may also
# carry other point-to-point traffic at the same time (ring attention's, when the ZeRO
# group is the context-parallel group), and gloo matches messages by peer and tag in
# the order they were posted.
_EXCHANGE_TAG = 0x5A


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
                    ranks: list[int], index: int, async_op: bool):
    """Concatenate every member's equal-sized `shard` into `output`, in rank order."""
    size = len(ranks)
    if shard.nbytes >= BROADCAST_GATHER_BYTES:
        # Large: each member broadcasts its slot of the output to the others.
        flat, slot = output.view(-1), shard.numel()
        mine = flat[index * slot:(index + 1) * slot]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard.reshape(-1))
        works = [dist.broadcast(flat[i * slot:(i + 1) * slot], src=src, group=group,
                                async_op=async_op)
                 for i, src in enumerate(ranks)]
        return _AllOf(works) if async_op else None
    # Small: every member sends its shard to every other in one all-to-all; the repeated
    # input takes the place of the staging buffer gloo's own all-gather allocates.
    send = shard.reshape(-1).repeat(size)
    work = dist.all_to_all_single(output.view(-1), send, group=group, async_op=async_op)
    return _Holding(work, send) if async_op else None


def reduce_scatter_flat(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup,
                        ranks: list[int], index: int, async_op: bool):
    """Sum `full` over members; member `index` keeps its equal slice in `shard`."""
    size = len(ranks)
    slot = full.numel() // size
    if is_pairwise(full, size):
        # Large: every pair of members exchanges the slices each owns, and each sums its
        # own in rank order.
        flat = full.view(-1)
        received = full.new_empty((size - 1, slot))
        pieces, works = [], []
        for i, peer in enumerate(ranks):
            piece = flat[i * slot:(i + 1) * slot]  # what member i owns
            if i == index:
                pieces.append(piece)
                continue
            into = received[len(works) // 2]
            works += [dist.irecv(into, src=peer, group=group, tag=_EXCHANGE_TAG),
                      dist.isend(piece, dst=peer, group=group, tag=_EXCHANGE_TAG)]
            pieces.append(into)
        work = _SumOnWait(works, pieces, shard)
    else:
        received = torch.empty_like(full)
        work = _SumOnWait([dist.all_to_all_single(received, full, group=group, async_op=True)],
                          received.view(size, slot), shard)
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter_scratch_bytes(full: torch.Tensor, size: int) -> int:
    """Extra bytes `reduce_scatter_flat(_, full, ...)` holds while in flight."""
    if is_pairwise(full, size):
        return full.nbytes // size * (size - 1)
    return full.nbytes


def is_pairwise(full: torch.Tensor, size: int) -> bool:
    """A reduce-scatter of `full` over `size` members runs as pairwise exchanges."""
    return full.nbytes // size >= PAIRWISE_REDUCE_BYTES


class _SumOnWait:
    """Work handle of a reduce-scatter: waits for the transfers, then sums the members'
    slices in rank order into the output shard. `pieces`: the received (members, slice)
    block of an all-to-all, or the list of slices of a pairwise exchange."""

    def __init__(self, works: list, pieces: torch.Tensor | list[torch.Tensor],
                 shard: torch.Tensor) -> None:
        self.transfers, self.pieces, self.shard = _AllOf(works), pieces, shard
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            self.transfers.wait()
            if isinstance(self.pieces, torch.Tensor):
                torch.sum(self.pieces, dim=0, out=self.shard.view(-1))
            else:
                _sum_in_rank_order(self.pieces, self.shard.view(-1))
            self.pieces = None  # the scratch goes as soon as it is summed
            self.done = True
        return True

    def is_completed(self) -> bool:
        """The transfers are done (wait() then only sums)."""
        return self.done or self.transfers.is_completed()


def _sum_in_rank_order(pieces: list[torch.Tensor], out: torch.Tensor) -> None:
    """out = ((p0 + p1) + p2) + ..., also when `out` is one of the pieces (stage 1 reduces
    into its own slot); every other piece is scratch the sum may overwrite."""
    j = next((i for i, p in enumerate(pieces) if p.data_ptr() == out.data_ptr()), None)
    if j is None:
        torch.add(pieces[0], pieces[1], out=out)
        j = 1
    elif j > 0:  # the pieces before out's summed into the first; then a + b == b + a
        for p in pieces[1:j]:
            pieces[0].add_(p)
        out.add_(pieces[0])
    for p in pieces[j + 1:]:
        out.add_(p)


class _AllOf:
    """Work handle over several collectives that together make one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class _Holding:
    """Work handle that keeps the tensor a collective reads from alive until waited."""

    def __init__(self, work, held: torch.Tensor) -> None:
        self.work, self.held = work, held

    def wait(self) -> bool:
        self.work.wait()
        self.held = None
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()
