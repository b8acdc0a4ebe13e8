"""The shared-memory transport of gloo groups (partita.shm_collectives): bitwise the gloo
forms' results, asynchronous handles, no file left behind, the fallback to gloo, and a
bounded wait for a member that never comes."""

from __future__ import annotations

import datetime
import errno
import math
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from partita import shm_collectives, shm_os, shm_share
from partita.comm import CommCounter, GroupComm
from partita.errors import PartitaError
from partita.gloo_collectives import BROADCAST_GATHER_BYTES, PAIRWISE_REDUCE_BYTES
from partita.layout import Layout
from partita.mesh import Mesh
from partita.shm_collectives import ShmGroup
from partita.shm_share import ShmTimeout
from partita.testing import run_distributed

# A small arena, so that modest tensors already go through in several chunks.
BUFFER = 256 * 1024
# A floor the mesh's transport is tested with (PARTITA_SHM_MIN_BYTES; by default none).
FLOOR = 4 * 1024 * 1024


def _data(rank: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def _match_worker(rank: int, world: int) -> dict:
    os.environ[shm_collectives.ENV_MIN_BYTES] = str(FLOOR)  # this forked rank only
    mesh = Mesh(Layout(dp=world), rank, world, shm_collectives=True)
    base = mesh.comm("zero_shard")
    assert base.shm is not None
    shm = GroupComm(base.group, base.ranks, rank, "shm", CommCounter(),
                    shm=ShmGroup(base.group, base.ranks, base.index, buffer_bytes=BUFFER,
                                   min_bytes=0))
    gloo = GroupComm(base.group, base.ranks, rank, "gloo", CommCounter())
    problems: list[str] = []
    with warnings.catch_warnings(record=True) as caught:  # setting up warns of nothing
        warnings.simplefilter("always")
        assert shm.shm.ready()
    problems += [f"setup warned: {w.message}" for w in caught]
    chunk = BUFFER // world  # one member's share of a buffer, in bytes
    # All-gather shards: tiny, around one chunk, and past gloo's broadcast threshold
    # (also many chunks); reduce-scatter slices: small (gloo's all-to-all form, summed
    # by torch.sum) and past the pairwise threshold (one add per member).
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        item = dtype.itemsize
        gathers = [3, chunk // item - 1, chunk // item + 7, BROADCAST_GATHER_BYTES // item + 5]
        slices = [5, BUFFER // (world * world * item) + 3, 100_003,
                  PAIRWISE_REDUCE_BYTES // item + 9]
        if dtype != torch.float32:
            slices.pop()  # the pairwise sum's rounding is checked in float32 and bfloat16
        if dtype == torch.bfloat16:
            slices.append(PAIRWISE_REDUCE_BYTES // item + 9)
        for n in gathers:
            shard = _data(rank, n, dtype, seed=n)
            outs = [torch.full((n * world,), 7, dtype=dtype) for _ in range(2)]
            for async_op, (comm, out) in zip((False, True), zip((shm, gloo), outs)):
                work = comm.all_gather_flat(out, shard, async_op=async_op)
                if work is not None:
                    work.wait()
            if not torch.equal(outs[0], outs[1]):
                problems.append(f"all-gather of {n} {dtype} differs from gloo's")
        for n in slices:
            full = _data(rank, n * world, dtype, seed=n)
            before = full.clone()
            outs = [torch.full((n,), float("nan"), dtype=dtype) for _ in range(2)]
            shm.reduce_scatter_flat(outs[0], full)
            gloo.reduce_scatter_flat(outs[1], full)
            if not torch.equal(outs[0], outs[1]):
                problems.append(f"reduce-scatter of {n} {dtype} differs from gloo's")
            if not torch.equal(full, before):
                problems.append(f"reduce-scatter of {n} {dtype} modified its input")
            # In place: the output is this rank's own slice of the input (stage 1).
            own = full[rank * n:(rank + 1) * n]
            shm.reduce_scatter_flat(own, full, async_op=True).wait()
            if not torch.equal(own, outs[1]):
                problems.append(f"in-place reduce-scatter of {n} {dtype} wrong")
    # All-to-all with variable splits (expert dispatch): rows of one to several slots,
    # none to some members, a member sending nothing at all, int64 counts; bitwise
    # gloo's result, since both only copy.
    slot_rows = BUFFER // (world * world) // (4 * 3)  # float32 rows of 3
    for case, per_dest in enumerate(([1] * world, [0, 5] * world, [slot_rows + 1] * world,
                                     [3 * slot_rows + 2, 0, 7, 1] * world)):
        splits = [[(per_dest[(src + dst) % len(per_dest)] if src != case % world or case < 3
                    else 0) for dst in range(world)] for src in range(world)]
        send, recv = splits[rank], [splits[src][rank] for src in range(world)]
        for dtype, width in ((torch.float32, (3,)), (torch.int64, ())):
            rows = _data(rank, sum(send) * math.prod(width), torch.float64, seed=case)
            x = rows.to(dtype).view(sum(send), *width)
            outs = [torch.full((sum(recv), *width), -1, dtype=dtype) for _ in range(2)]
            shm.all_to_all_single(outs[0], x, recv, send)
            gloo.all_to_all_single(outs[1], x, recv, send)
            if not torch.equal(outs[0], outs[1]):
                problems.append(f"all-to-all case {case} {dtype} differs from gloo's")
    # All-reduce: one chunk, several (neither a multiple of the group size), in place.
    # The sums run in another order than gloo's ring (bitwise alike at 2 members, where
    # each is one commutative add); every member must hold the same bytes.
    for dtype in (torch.float32, torch.float64):
        for n in (7, BUFFER // (world * dtype.itemsize) - 3, 3 * BUFFER // dtype.itemsize + 5):
            mine = _data(rank, n, dtype, seed=n)
            ours, theirs = mine.clone(), mine.clone()
            shm.all_reduce(ours, async_op=True).wait()
            gloo.all_reduce(theirs)
            exact = sum(_data(r, n, torch.float64, seed=n) for r in range(world))
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            if world == 2 and not torch.equal(ours, theirs):
                problems.append(f"all-reduce of {n} {dtype} differs from gloo's at 2")
            if not torch.allclose(ours.double(), exact.to(dtype).double(), rtol=tol, atol=tol):
                problems.append(f"all-reduce of {n} {dtype} is not the sum")
            every = torch.empty(world * n, dtype=dtype)
            gloo.all_gather_flat(every, ours)
            if not all(torch.equal(part, ours) for part in every.view(world, n)):
                problems.append(f"all-reduce of {n} {dtype} differs between members")
    # Several in flight, waited out of order, the shard aliasing the output's own slot.
    n = 3 * chunk // 4 + 1
    expected = [torch.cat([_data(r, n, torch.float32, seed=s) for r in range(world)])
                for s in range(3)]
    outs = [torch.zeros(n * world) for _ in range(3)]
    works = []
    for s, out in enumerate(outs):
        out[rank * n:(rank + 1) * n] = _data(rank, n, torch.float32, seed=s)
        works.append(shm.all_gather_flat(out, out[rank * n:(rank + 1) * n], async_op=True))
    full = _data(rank, 40 * world, torch.float32, seed=9)
    rs_out, rs_ref = torch.empty(40), torch.empty(40)
    works.append(shm.reduce_scatter_flat(rs_out, full, async_op=True))
    gloo.reduce_scatter_flat(rs_ref, full)
    for work in reversed(works):
        work.wait()
        assert work.is_completed()
    if not (all(torch.equal(o, e) for o, e in zip(outs, expected))
            and torch.equal(rs_out, rs_ref)):
        problems.append("asynchronous collectives waited out of order wrong")
    # Reuse: many calls alternate the arena's buffers.
    for i in range(60):
        out = torch.empty(world * 5)
        shm.all_gather_flat(out, torch.full((5,), float(rank + i)))
        if out.tolist() != [float(r + i) for r in range(world) for _ in range(5)]:
            problems.append(f"call {i} of a series wrong")
            break
    # The mesh's own transport: below its floor gloo's forms (the arena not even set
    # up), from the floor on the arena, set up on first use; counted as gloo's would be.
    small, n = torch.empty(world * 1000), FLOOR // (4 * world)
    base.all_gather_flat(small, torch.ones(1000))
    if base.shm.state is not None:
        problems.append("a collective below the floor set the arena up")
    out = torch.empty(world * n)
    base.all_gather_flat(out, torch.ones(n))
    base.reduce_scatter_flat(torch.empty(n), torch.ones(world * n))
    base.reduce_scatter_flat(torch.empty(1000), torch.ones(world * 1000))
    calls = base.shm.calls
    summed = torch.ones(world * n)
    base.all_reduce(summed)
    if base.shm.calls != calls + 1 or not torch.equal(summed, torch.full_like(summed, world)):
        problems.append("an all-reduce from the floor on did not go through the arena")
    base.all_reduce(torch.ones(1000))
    base.all_reduce(torch.ones(world * n, dtype=torch.int64))
    base.all_reduce(torch.ones(world * n), op=dist.ReduceOp.MAX)
    if base.shm.calls != calls + 1:
        problems.append("a small, integer or MAX all-reduce went through the arena")
    gloo.counter.reset()
    gloo.all_gather_flat(small, torch.ones(1000))
    gloo.all_gather_flat(out, torch.ones(n))
    gloo.reduce_scatter_flat(torch.empty(n), torch.ones(world * n))
    gloo.reduce_scatter_flat(torch.empty(1000), torch.ones(world * 1000))
    gloo.all_reduce(torch.ones(world * n))
    gloo.all_reduce(torch.ones(1000))
    gloo.all_reduce(torch.ones(world * n, dtype=torch.int64))
    gloo.all_reduce(torch.ones(world * n), op=dist.ReduceOp.MAX)
    if dict(base.counter.sent) != {("zero_shard", k[1]): v for k, v in gloo.counter.sent.items()}:
        problems.append("bytes counted differ from gloo's")
    if base.reduce_scatter_scratch_bytes(torch.ones(world * n)) != 0:
        problems.append("scratch bytes counted through shared memory")
    if base.reduce_scatter_scratch_bytes(torch.ones(world * 1000)) == 0:
        problems.append("no scratch counted for a reduce-scatter below the floor")
    used = {"mesh": base.shm.calls, "test": shm.shm.calls}
    return {"problems": problems, "used": used, "state": shm.shm.state,
            "path": getattr(shm.shm, "path", None)}


@pytest.mark.parametrize("world", [2, 4])
def test_matches_gloo_forms(world: int) -> None:
    results = run_distributed(_match_worker, world, timeout=120)
    for rank, result in enumerate(results):
        assert result["problems"] == [], f"rank {rank}: {result['problems']}"
        assert result["state"] is True
        assert result["used"]["mesh"] == 3 and result["used"]["test"] > 50
    # Unlinked once mapped: nothing left in /dev/shm.
    assert results[0]["path"] and not os.path.exists(results[0]["path"])


def _floor_worker(rank: int, world: int, floor: str | None) -> tuple:
    if floor is not None:
        os.environ[shm_collectives.ENV_MIN_BYTES] = floor  # this forked rank only
    comm = Mesh(Layout(dp=world), rank, world, shm_collectives=True).comm("zero_shard")
    summed = torch.full((10,), float(rank + 1))
    comm.all_reduce(summed)
    return comm.shm.calls, summed.tolist()


def test_the_floor_comes_from_the_environment(monkeypatch) -> None:
    """By default every flat collective goes through the arena, a 40-byte all-reduce
    too; PARTITA_SHM_MIN_BYTES sets a floor below which gloo's forms stay, and anything
    but a whole number of bytes is refused with the fix."""
    monkeypatch.delenv(shm_collectives.ENV_MIN_BYTES, raising=False)
    assert shm_collectives.floor_bytes() == shm_collectives.MIN_BYTES == 0
    for raw, want in (("0", 0), (" 65536 ", 65536)):
        monkeypatch.setenv(shm_collectives.ENV_MIN_BYTES, raw)
        assert shm_collectives.floor_bytes() == want
    for raw in ("-1", "4MiB", "1e6"):
        monkeypatch.setenv(shm_collectives.ENV_MIN_BYTES, raw)
        with pytest.raises(PartitaError, match="PARTITA_SHM_MIN_BYTES=.* whole number"):
            shm_collectives.floor_bytes()
    monkeypatch.delenv(shm_collectives.ENV_MIN_BYTES)
    for floor, through_arena in ((None, 1), ("0", 1), ("41", 0)):
        for calls, summed in run_distributed(_floor_worker, 2, args=(floor,), timeout=60):
            assert calls == through_arena and summed == [3.0] * 10


def _disagreeing_worker(rank: int, world: int, variable: str, value: str) -> list[str]:
    if rank == 1:
        os.environ[variable] = value  # this forked rank only
    said = []
    for choice in (None, True):  # left to the environment; chosen by the caller
        try:
            Mesh(Layout(dp=world), rank, world, shm_collectives=choice)
            said.append("built")
        except PartitaError as exc:
            said.append(str(exc))
    return said


def test_an_unreadable_floor_on_one_process_stops_every_process() -> None:
    """The process whose PARTITA_SHM_MIN_BYTES is not a number says so, and the others
    stop with it rather than waiting for it in the agreement."""
    variable = shm_collectives.ENV_MIN_BYTES
    (mine, _), (theirs, _) = run_distributed(_disagreeing_worker, 2,
                                             args=(variable, "4MiB"), timeout=60)
    assert mine.startswith("another process's PARTITA_SHM_MIN_BYTES is not a byte count")
    assert theirs.startswith("PARTITA_SHM_MIN_BYTES='4MiB' is not a byte count")


@pytest.mark.parametrize("variable, value, what", [
    (shm_share.ENV_SWITCH, "0", "some processes use the shared-memory collectives"),
    (shm_collectives.ENV_MIN_BYTES, "65536", "from different sizes (0 to 65536 bytes)")])
def test_processes_that_disagree_are_refused_together(variable, value, what) -> None:
    """Processes that would send different collectives through the arena are refused
    when the mesh is built, every one with the same message naming both variables,
    rather than waiting for each other until a collective times out."""
    results = run_distributed(_disagreeing_worker, 2, args=(variable, value), timeout=60)
    for said in results:
        if variable == shm_share.ENV_SWITCH:  # the caller's choice overrides it
            assert said[1] == "built"
        else:
            assert said[1] == said[0]
        assert what in said[0] and "PARTITA_SHM_MIN_BYTES" in said[0], said[0]
        assert "PARTITA_SHM_COLLECTIVES" in said[0]
    assert results[0] == results[1]


def _fallback_worker(rank: int, world: int) -> dict:
    out: dict = {}
    n = 1024

    def gather_once() -> tuple:
        """(arena state, calls through it, result right, warnings given) of one gather
        on a fresh mesh."""
        shm_share._warned = False
        comm = Mesh(Layout(dp=world), rank, world, shm_collectives=True).comm("zero_shard")
        gathered = torch.empty(world * n)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comm.all_gather_flat(gathered, torch.full((n,), float(rank)))
        right = torch.equal(gathered, torch.arange(world).repeat_interleave(n).float())
        ours = [w for w in caught if str(w.message).startswith("partita: collectives")]
        out["said"] = [str(w.message) for w in ours]
        return comm.shm.state, comm.shm.calls, right, len(ours)

    # No /dev/shm on the member that makes the arena: every member keeps gloo's forms,
    # and says so.
    shm_share.SHM_DIR = "/nonexistent-partita-shm"
    out["fallback"] = gather_once()
    shm_share.SHM_DIR = "/dev/shm"
    # A full /dev/shm (a container's 64 MB): the warning says how to give it room.
    made = shm_share._create

    def full(nbytes: int, token: bytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    shm_share._create = full
    out["full"] = (*gather_once(), any("--shm-size" in m for m in out["said"]))
    shm_share._create = made
    # The last member on another host (another boot id): gloo's forms, quietly.
    own_host = shm_os.host_id
    if rank == world - 1:
        shm_os.host_id = lambda: bytes(range(16))
    out["elsewhere"] = gather_once()
    shm_os.host_id = own_host
    # On by default; off through the environment, unless the caller says otherwise.
    def has_shm(**kw) -> bool:
        return Mesh(Layout(dp=world), rank, world, **kw).comm("zero_shard").shm is not None

    saved = os.environ.pop(shm_share.ENV_SWITCH, None)
    out["default_on"] = has_shm() and not has_shm(shm_collectives=False)
    os.environ[shm_share.ENV_SWITCH] = "0"
    out["env_off"] = not has_shm() and has_shm(shm_collectives=True)
    os.environ[shm_share.ENV_SWITCH] = "1"
    out["env_on"] = has_shm() and not has_shm(shm_collectives=False)
    del os.environ[shm_share.ENV_SWITCH]
    if saved is not None:
        os.environ[shm_share.ENV_SWITCH] = saved
    # A member that never arrives: the other gives up after the group's timeout.
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    shm = ShmGroup(group, [0, 1], rank)
    assert shm.ready()
    start = time.monotonic()
    if rank == 0:
        try:
            shm.all_gather(torch.empty(2), torch.ones(1), async_op=False)
            out["timeout"] = "no error"
        except ShmTimeout:
            out["timeout"] = time.monotonic() - start
        try:  # the arena is out of step now: every later call refuses
            shm.all_gather(torch.empty(2), torch.ones(1), async_op=True).wait()
            out["after"] = "no error"
        except RuntimeError as exc:
            out["after"] = str(exc)
    dist.barrier()
    return out


def test_fallback_switches_and_timeout() -> None:
    results = run_distributed(_fallback_worker, 2, timeout=60)
    for rank, out in enumerate(results):
        assert out["fallback"] == (False, 0, True, 1), f"rank {rank}"
        # Only the member that makes the arena knows why; it says so, with the fix.
        assert out["full"] == ((False, 0, True, 1, True) if rank == 0
                               else (False, 0, True, 1, False)), f"rank {rank}"
        assert out["elsewhere"] == (False, 0, True, 0), f"rank {rank}"
        assert out["default_on"] and out["env_on"] and out["env_off"]
    assert 0.9 <= results[0]["timeout"] < 10
    assert "failed" in results[0]["after"]


def test_a_waiting_member_sees_a_peer_process_end() -> None:
    """A wait gives up as soon as a member's process has ended (as gloo notices its
    closed connection), not at the end of the timeout; a zombie counts as ended."""
    import subprocess

    proc = subprocess.Popen(["sleep", "30"])
    try:
        peer = (proc.pid, shm_os.identity(proc.pid)[0])
        assert shm_os.alive(peer)
        assert not shm_os.alive((proc.pid, peer[1] + 1))  # another process
        proc.kill()
        deadline = time.monotonic() + 5
        while shm_os.alive(peer) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not shm_os.alive(peer)  # not reaped yet: a zombie
    finally:
        proc.kill()
        proc.wait()
    assert not shm_os.alive(peer)
