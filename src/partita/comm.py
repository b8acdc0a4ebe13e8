"""Every collective partita issues goes through here, so bytes can be counted in one place.

`GroupComm` binds one process group to its purpose ("tensor", "zero_shard", ...) and to
the run's `CommCounter`. A group of one member makes every call a no-op, so single-rank
code paths need no special cases. The autograd-aware operators of tensor and sequence
parallelism (Megatron's f and g and their sequence-parallel variants) live at the end.

Bytes sent are counted per rank as a ring implementation sends them:
all-reduce 2(n-1)/n * S, all-gather and reduce-scatter (n-1)/n * S (S = the full,
unsharded tensor), all-to-all (n-1)/n * S, point-to-point S.

On gloo, flat all-gathers and reduce-scatters, all-reduces that sum floating tensors
and all-to-alls go through shared memory where switched on and every member of the
group runs on this host (`partita.shm_collectives`: every size, or from
PARTITA_SHM_MIN_BYTES where that is set, which keeps all-to-alls on gloo); otherwise
the first two take faster forms than gloo's own (`partita.gloo_collectives`). NCCL
keeps its native collectives.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from partita import gloo_collectives
from partita.eager_only import EagerOnly

if TYPE_CHECKING:
    from partita.shm_collectives import ShmGroup

# torch 2.13 renamed the flat-tensor collectives (the old names warn); keep working on
# older releases too. Everything in partita calls them by these names.
dist_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
dist_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommCounter:
    """Bytes this rank sent, keyed by (purpose, operation)."""

    sent: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def record(self, purpose: str, op: str, nbytes: float) -> None:
        self.sent[(purpose, op)] += nbytes
        self.calls[(purpose, op)] += 1

    def total(self, purpose: str | None = None, op: str | None = None) -> float:
        return sum(
            v for (p, o), v in self.sent.items()
            if (purpose is None or p == purpose) and (op is None or o == op)
        )

    def reset(self) -> None:
        self.sent.clear()
        self.calls.clear()


class _Done:
    """Stands in for a work handle when there was nothing to communicate."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class GroupComm:
    """Collectives over one process group, counted under one purpose. `shm`: the
    group's shared-memory transport (`partita.mesh.Mesh` makes one per group when asked), used
    for flat all-gathers and reduce-scatters once it is set up; None keeps gloo's."""

    def __init__(self, group: dist.ProcessGroup | None, ranks: list[int], rank: int,
                 purpose: str, counter: CommCounter, shm: ShmGroup | None = None) -> None:
        self.group = group
        self.ranks = ranks
        self.size = len(ranks)
        self.index = ranks.index(rank)
        self.purpose = purpose
        self.counter = counter
        self.shm = shm

    @functools.cached_property  # asked of the group when first needed
    def backend(self) -> str | None:
        """The group's backend ("gloo", "nccl"), or None when there is nobody to
        communicate with (one member, or no process group)."""
        if self.size == 1 or not dist.is_initialized():
            return None
        return str(dist.get_backend(self.group))

    @property
    def scalar_device(self) -> torch.device:
        """Where small tensors made for a collective (scalars, bounds) must live: NCCL
        communicates CUDA tensors only, gloo CPU ones."""
        if self.backend == dist.Backend.NCCL:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def gloo_forms(self) -> bool:
        """Flat reduce-scatters and all-gathers take partita's own forms
        (`partita.gloo_collectives`: all-to-alls, or point to point when large)."""
        return self.backend == dist.Backend.GLOO

    @property
    def shared_transfers(self) -> bool:
        """This gloo group's all-to-alls and point-to-point transfers go through shared
        memory (`partita.shm_collectives`, `partita.shm_channel`): where its collectives
        do at every size. Not with a floor: the members' byte counts differ there, so a
        floor could send some members through shared memory and the others through gloo."""
        return self.gloo_forms and self.shm is not None and self.shm.min_bytes == 0

    def _shm_ready(self, whole: torch.Tensor, part: torch.Tensor) -> bool:
        """The flat collective on `whole` (gathered or reduced) and `part` (this
        member's slice) goes through shared memory. The first such call sets the arena
        up, collectively: every member reaches it at the same call, since all issue the
        group's collectives, with the same sizes, in the same order."""
        return (self.shm is not None and self.gloo_forms
                and whole.device.type == "cpu" and part.device.type == "cpu"
                and self.shm.carries(_nbytes(whole)) and self.shm.ready())

    def _count(self, op: str, nbytes: float) -> None:
        self.counter.record(self.purpose, op, nbytes)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        if self.size == 1:
            return _Done() if async_op else None
        self._count("all_reduce", 2 * (self.size - 1) / self.size * _nbytes(tensor))
        if (op == dist.ReduceOp.SUM and tensor.is_floating_point() and tensor.is_contiguous()
                and self._shm_ready(tensor, tensor)):
            return self.shm.all_reduce(tensor, async_op)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def all_gather_flat(self, output: torch.Tensor, shard: torch.Tensor,
                        async_op: bool = False):
        """Concatenate every member's equal-sized `shard` into `output`, in rank order."""
        if self.size == 1:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return _Done() if async_op else None
        self._count("all_gather", (self.size - 1) / self.size * _nbytes(output))
        if self._shm_ready(output, shard):
            return self.shm.all_gather(output, shard, async_op)
        if self.gloo_forms:
            return gloo_collectives.all_gather_flat(output, shard, self.group, self.ranks,
                                                    self.index, async_op)
        return dist_all_gather_flat(output, shard, group=self.group, async_op=async_op)

    def reduce_scatter_flat(self, shard: torch.Tensor, full: torch.Tensor,
                            op=dist.ReduceOp.SUM, async_op: bool = False):
        """Sum `full` over members; member i keeps the i-th equal slice in `shard`."""
        if self.size == 1:
            if shard.data_ptr() != full.data_ptr():
                shard.copy_(full)
            return _Done() if async_op else None
        self._count("reduce_scatter", (self.size - 1) / self.size * _nbytes(full))
        if op == dist.ReduceOp.SUM and self._shm_ready(full, shard):
            return self.shm.reduce_scatter(
                shard, full, gloo_collectives.is_pairwise(full, self.size), async_op)
        if self.gloo_forms and op == dist.ReduceOp.SUM:
            return gloo_collectives.reduce_scatter_flat(shard, full, self.group, self.ranks,
                                                        self.index, async_op)
        return dist_reduce_scatter_flat(shard, full, op=op, group=self.group, async_op=async_op)

    def reduce_scatter_scratch_bytes(self, full: torch.Tensor) -> int:
        """Extra bytes `reduce_scatter_flat(_, full)` holds while in flight (none through
        shared memory, whose arena is fixed and shared by the group)."""
        if not self.gloo_forms or (self.shm is not None and self.shm.state
                                   and self.shm.carries(_nbytes(full))):
            return 0
        return gloo_collectives.reduce_scatter_scratch_bytes(full, self.size)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_splits: list[int], input_splits: list[int],
                          op: str = "all_to_all") -> None:
        """Rows input_splits[j] of `input` to member j; output_splits[j] rows from it.
        Counted: the rows sent to the other members (variable splits: expert dispatch)."""
        if self.size == 1:
            output.copy_(input)
            return
        row = math.prod(input.shape[1:]) * input.element_size()  # also with no rows
        others = sum(input_splits) - input_splits[self.index]
        self._count(op, others * row)
        if self.shared_transfers and self._shm_ready(output, input):
            return self.shm.all_to_all(output, input.contiguous(), output_splits,
                                       input_splits, row)
        dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src_index: int = 0) -> None:
        if self.size == 1:
            return
        if self.index == src_index:
            self._count("broadcast", _nbytes(tensor))
        dist.broadcast(tensor, src=self.ranks[src_index], group=self.group)

    def p2p_op(self, send: bool, tensor: torch.Tensor, peer_rank: int) -> dist.P2POp:
        """A point-to-point op for `dist.batch_isend_irecv`; sends are counted."""
        if send:
            self.count_send(tensor)
        return dist.P2POp(dist.isend if send else dist.irecv, tensor, peer_rank, self.group)

    def count_send(self, tensor: torch.Tensor) -> None:
        """Count a point-to-point send (made here or through shared memory)."""
        self._count("send", _nbytes(tensor))

    def all_reduce_scalars(self, values: list[float], op=dist.ReduceOp.SUM,
                           dtype: torch.dtype = torch.float64) -> list[float]:
        """All-reduce a few Python numbers (loss sums, norms, flags) in one call."""
        t = torch.tensor(values, dtype=dtype, device=self.scalar_device)
        self.all_reduce(t, op=op)
        return t.tolist()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# Autograd-aware operators of tensor / sequence parallelism ------------------------------
# Megatron's names: f = identity forward, all-reduce backward (enter a tp region);
# g = all-reduce forward, identity backward (leave a tp region).
# Their entry points are `EagerOnly` (partita.eager_only): a compiled block
# (partita.compile) runs each eagerly between its compiled pieces instead of tracing
# into gloo or NCCL.


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        # A copy: autograd may hand the same gradient tensor to other consumers (an add's
        # backward passes one tensor to both inputs); reducing it in place corrupts them.
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.comm.all_reduce(grad)
        return grad, None


class _CopyEachToRegion(torch.autograd.Function):
    """f on several tensors: one all-reduce per dtype of their gradients in backward,
    not one per tensor (each all-reduce of a small gradient costs mostly latency).
    Gradients are materialised (zeros for an output that took no part), so every rank
    reduces the same tensors whatever its data did."""

    @staticmethod
    def forward(ctx, comm, *xs):
        ctx.comm = comm
        return xs

    @staticmethod
    def backward(ctx, *grads):
        out: list[torch.Tensor | None] = list(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            if g is not None:
                by_dtype.setdefault(g.dtype, []).append(i)
        for indices in by_dtype.values():
            # torch.cat copies, so the reduction never touches a gradient autograd may
            # also hand to another consumer (see _CopyToRegion).
            flat = torch.cat([grads[i].reshape(-1) for i in indices])
            ctx.comm.all_reduce(flat)
            sizes = [grads[i].numel() for i in indices]
            for i, piece in zip(indices, flat.split(sizes)):
                out[i] = piece.view(grads[i].shape)
        return (None, *out)


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        x = x.contiguous().clone()
        comm.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 1 (sequence) forward; reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_dim1(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim1(grad, ctx.comm), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along dim 1 (sequence) forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_dim1(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather_dim1(grad, ctx.comm), None


class _ScatterSequence(torch.autograd.Function):
    """Keep this rank's slice of dim 1 forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.chunk(comm.size, dim=1)[comm.index].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_dim1(grad, ctx.comm), None


class _GatherSequenceToReplica(_GatherSequence):
    """All-gather along dim 1 (sequence) forward; this rank's slice of the gradient
    backward. For a consumer that every member computes alike on the whole sequence (a
    module replicated over the group): its input gradient is then the same on every
    member, already complete, so each keeps its own slice where `_GatherSequence`
    would sum the copies."""

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.comm.size, dim=1)[ctx.comm.index].contiguous(), None


class _SumEverywhere(_ReduceFromRegion):
    """The sum over the group, on every member; backward the same sum of the gradients,
    since every member goes on with the result (g's backward passes its gradient on as
    it is: the members there hold partial sums of one replicated result)."""

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad, None


def gather_along(x: torch.Tensor, comm: GroupComm, dim: int) -> torch.Tensor:
    """Every member's equal-shaped `x` concatenated along `dim`, in rank order."""
    if comm.size == 1:
        return x
    # all_gather_flat concatenates along dim 0 (contiguous): move `dim` there and back.
    moved = x.transpose(0, dim).contiguous()
    out = moved.new_empty((comm.size * moved.shape[0], *moved.shape[1:]))
    comm.all_gather_flat(out, moved)
    return out.transpose(0, dim).contiguous()


def _gather_dim1(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    return gather_along(x, comm, 1)


def _reduce_scatter_dim1(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    if comm.size == 1:
        return x
    x = x.transpose(0, 1).contiguous()
    out = x.new_empty((x.shape[0] // comm.size, *x.shape[1:]))
    comm.reduce_scatter_flat(out, x)
    return out.transpose(0, 1).contiguous()


@EagerOnly
def copy_to_region(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    return x if comm.size == 1 else _CopyToRegion.apply(x, comm)


@EagerOnly
def copy_each_to_region(tensors: list[torch.Tensor], comm: GroupComm) -> list[torch.Tensor]:
    """`copy_to_region` of each tensor, in one call: compiled code breaks its graph once
    for all of them (a break inside a comprehension would make dynamo give up on the
    whole calling function and run it eagerly), and backward sums their gradients over
    the group in one all-reduce per dtype."""
    return tensors if comm.size == 1 else list(_CopyEachToRegion.apply(comm, *tensors))


@EagerOnly
def reduce_from_region(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    return x if comm.size == 1 else _ReduceFromRegion.apply(x, comm)


@EagerOnly
def gather_sequence(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    return x if comm.size == 1 else _GatherSequence.apply(x, comm)


@EagerOnly
def reduce_scatter_sequence(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    return x if comm.size == 1 else _ReduceScatterSequence.apply(x, comm)


@EagerOnly
def scatter_sequence(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    return x if comm.size == 1 else _ScatterSequence.apply(x, comm)


@EagerOnly
def gather_sequence_to_replica(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    return x if comm.size == 1 else _GatherSequenceToReplica.apply(x, comm)


@EagerOnly
def sum_everywhere(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    """Every member's `x` summed, on every member, differentiably (see _SumEverywhere)."""
    return x if comm.size == 1 else _SumEverywhere.apply(x, comm)
