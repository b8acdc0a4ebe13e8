"""GroupComm's flat collectives on gloo (all-to-all and broadcast based) against plain
arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from partita.comm import copy_each_to_region
from partita.gloo_collectives import BROADCAST_GATHER_BYTES, PAIRWISE_REDUCE_BYTES
from partita.layout import Layout
from partita.mesh import Mesh
from partita.testing import run_distributed


def _full(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def _finish(work, async_op: bool) -> None:
    """Wait for an asynchronous collective (a synchronous one returns nothing)."""
    if async_op:
        work.wait()
        assert work.is_completed()


def _worker(rank: int, world: int) -> list[str]:
    # gloo's own forms; the shared-memory transport of one host's groups is checked
    # against them in tests/dist/test_shm_collectives.py.
    comm = Mesh(Layout(dp=world), rank, world, shm_collectives=False).comm("zero_shard")
    problems = []
    assert comm.gloo_forms and comm.shm is None  # the all-to-all path is under test
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        numel = 12 * world
        expected = sum(_full(r, numel, dtype).double() for r in range(world))
        expected = expected.view(world, -1)[rank]
        for async_op in (False, True):
            full = _full(rank, numel, dtype)
            before = full.clone()
            shard = torch.full((numel // world,), float("nan"), dtype=dtype)
            work = comm.reduce_scatter_flat(shard, full, async_op=async_op)
            if async_op:
                # The transfer may already be done (is_completed may say so), but the
                # slices are summed into the shard only by wait().
                assert work is not None and shard.isnan().all()
                work.wait()
                assert work.is_completed()
                work.wait()  # a second wait must not sum again
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
            if not torch.allclose(shard.double(), expected, rtol=tol, atol=tol):
                problems.append(f"{dtype} async={async_op}: wrong sum")
            if not torch.equal(full, before):
                problems.append(f"{dtype} async={async_op}: input was modified")
        # The output may be the owned slice of the input itself (ZeRO stage 1 in place).
        full = _full(rank, numel, dtype)
        in_place = full[rank * 12:(rank + 1) * 12]
        comm.reduce_scatter_flat(in_place, full, async_op=True).wait()
        if not torch.allclose(in_place.double(), expected, rtol=1e-2, atol=1e-2):
            problems.append(f"{dtype}: in-place output wrong")
    # Large slices go by pairwise exchange, summed in rank order: in float64 every rank's
    # slice equals ((x0 + x1) + x2) + ... exactly, into a separate shard or in place.
    slot = PAIRWISE_REDUCE_BYTES // 8 + 5
    inputs = [_full(r, slot * world, torch.float64) for r in range(world)]
    expected = inputs[0].clone()
    for x in inputs[1:]:
        expected += x
    expected = expected.view(world, -1)[rank]
    for async_op in (False, True):
        for in_place in (False, True):
            full = inputs[rank].clone()
            shard = (full[rank * slot:(rank + 1) * slot] if in_place
                     else torch.empty(slot, dtype=torch.float64))
            _finish(comm.reduce_scatter_flat(shard, full, async_op=async_op), async_op)
            if not torch.equal(shard, expected):
                problems.append(f"pairwise reduce-scatter async={async_op} "
                                f"in_place={in_place} wrong")
    if comm.reduce_scatter_scratch_bytes(full) != 8 * slot * (world - 1):
        problems.append("pairwise reduce-scatter scratch is not (n-1)/n of the buffer")
    # Other reductions keep gloo's own collective.
    full = _full(rank, 4 * world, torch.float64)
    shard = torch.empty(4, dtype=torch.float64)
    comm.reduce_scatter_flat(shard, full, op=dist.ReduceOp.MAX)
    expected = torch.stack([_full(r, 4 * world, torch.float64) for r in range(world)])
    if not torch.equal(shard, expected.max(0).values.view(world, -1)[rank]):
        problems.append("MAX reduce-scatter wrong")
    sent = comm.counter.total(op="reduce_scatter")
    if sent <= 0:
        problems.append("reduce-scatter bytes were not counted")
    # All-gather: out of a separate shard, and in place (the shard is the output's slot,
    # as stage 1 gathers), synchronous and asynchronous; small shards go by all-to-all,
    # large ones by one broadcast per member.
    for dtype in (torch.float64, torch.bfloat16):
        large = BROADCAST_GATHER_BYTES // dtype.itemsize + 3
        for n in (5, large):
            expected = torch.cat([_full(r, n, dtype) for r in range(world)])
            for async_op in (False, True):
                for in_place in (False, True):
                    output = torch.zeros(n * world, dtype=dtype)
                    if in_place:
                        shard = output[rank * n:(rank + 1) * n]
                        shard.copy_(_full(rank, n, dtype))
                    else:
                        shard = _full(rank, n, dtype)
                    _finish(comm.all_gather_flat(output, shard, async_op=async_op), async_op)
                    if not torch.equal(output, expected):
                        problems.append(f"all-gather of {n} {dtype} async={async_op} "
                                        f"in_place={in_place} wrong")
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_flat_collectives(world: int) -> None:
    for rank, problems in enumerate(run_distributed(_worker, world, timeout=120)):
        assert problems == [], f"rank {rank}: {problems}"


def _copy_each_worker(rank: int, world: int) -> list[str]:
    """copy_each_to_region: identity forward; backward each input's gradient summed over
    the group (zero for an output left unused), one all-reduce per dtype."""
    comm = Mesh(Layout(tp=world), rank, world).comm("tensor")
    shapes = {"a": ((3, 4), torch.float64), "b": ((5,), torch.float32),
              "c": ((2, 2), torch.float64), "unused": ((3,), torch.float64)}
    xs = [torch.zeros(shape, dtype=dtype, requires_grad=True) for shape, dtype in shapes.values()]
    outs = copy_each_to_region(xs, comm)
    problems = [f"{name}: forward is not the identity"
                for name, x, y in zip(shapes, xs, outs) if not torch.equal(x, y)]
    calls = comm.counter.calls
    # Each rank's gradient of output i is (rank + 1) * (i + 1) everywhere.
    loss = sum(((rank + 1) * (i + 1) * y).sum() for i, y in enumerate(outs[:3]))
    loss.backward()
    total = world * (world + 1) // 2
    for i, (name, x) in enumerate(list(zip(shapes, xs))[:3]):
        if not torch.equal(x.grad, torch.full_like(x, total * (i + 1))):
            problems.append(f"{name}: gradient {x.grad.flatten()[:3]} is not the group's sum")
    if not torch.equal(xs[3].grad, torch.zeros(3, dtype=torch.float64)):
        problems.append("an unused output's gradient is not zero")
    reductions = sum(n for (_, op), n in calls.items() if op == "all_reduce")
    if reductions != 2:
        problems.append(f"{reductions} all-reduces, not 2")
    return problems


def test_copy_each_to_region_sums_every_gradient_in_one_reduction_per_dtype() -> None:
    for rank, problems in enumerate(run_distributed(_copy_each_worker, 2, timeout=120)):
        assert problems == [], f"rank {rank}: {problems}"
