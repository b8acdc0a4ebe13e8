"""Data parallelism (ZeRO stage 0) against one process, and its communication rules."""

from __future__ import annotations

import pytest
import torch

from partita.layout import Layout
from partita.mesh import Mesh
from partita.testing import FLOAT32_TOL, Case, check_layouts, parity_config, run_distributed
from partita.zero import DataParallel, MixedPrecision, ZeroConfig
from tests.dist import dp_cases as zp

STEPS = 10


def dp_case(name: str, stage: int = 0, microbatches: int = 1, clip: float = 1.0,
            dtype: str = "float64") -> Case:
    parallel = dict(zero_stage=stage, bucket_mb=0.02)
    if dtype == "float32":  # at the default rate: see tests/dist/test_zero_parity.py
        cfg = parity_config(parallel=parallel, train=dict(microbatches=microbatches,
                                                          dtype=dtype, grad_clip=clip))
        return Case(name, cfg, tol=FLOAT32_TOL, grads_at=(0,), params=True)
    cfg = parity_config(parallel=parallel, train=dict(microbatches=microbatches, lr=1e-2,
                                                      grad_clip=clip))
    # Gradients are whole on every rank only without ZeRO.
    return Case(name, cfg, grads_at=(0,) if stage == 0 else (), params=True)


CASES = {
    2: [dp_case("dp-m1"), dp_case("dp-m2", microbatches=2),
        # Exactness: with 2 ranks an all-reduce and a reduce-scatter add the same two
        # numbers, so without clipping (whose norm sums in another order) stages 1 and 2
        # must equal stage 0 bit for bit.
        dp_case("dp-noclip", clip=0), dp_case("zero1-noclip", stage=1, clip=0),
        dp_case("zero2-noclip", stage=2, clip=0),
        dp_case("dp-m2-fp32", microbatches=2, dtype="float32")],
    4: [dp_case("dp-m1"), dp_case("dp-m2", microbatches=2)],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_data_parallel_matches_single_process(world: int) -> None:
    results = check_layouts(CASES[world], world, STEPS)
    if world == 2:
        base = results[2][0][0]
        for ranks, _ in results[3:5]:
            got = ranks[0]
            assert got["losses"] == base["losses"]
            for name, (_, value) in base["params"].items():
                assert torch.equal(got["params"][name][1], value), name


def _comm_worker(rank: int, world: int) -> dict:
    mesh = Mesh(Layout(dp=world), rank, world)
    model = zp.make_model({}, torch.float64)
    dp = DataParallel(model, mesh, zero=ZeroConfig(stage=0, bucket_mb=0.02),
                      precision=MixedPrecision(param_dtype=torch.float64))
    local = zp.batch(0).chunk(world)[rank]
    out = {}
    for m, micro in enumerate(local.chunk(2)):
        with dp.grad_sync(m == 1):
            dp.backward(zp.lm_loss(dp.module(micro[:, :-1]), micro))
        dp.reducer.wait_all() if m == 1 else None
        out[m] = mesh.counter.total("zero_shard")
    dp.finish_grad_sync()
    out["total"] = mesh.counter.total("zero_shard")
    # .grad stayed a view into the flat buckets (autograd accumulated in place).
    out["views"] = all(p.grad.data_ptr() == b.grad_view(i).data_ptr()
                       for b in dp.buckets for i, p in enumerate(b.params))
    out["buckets"] = len(dp.buckets)
    out["bytes"] = sum(b.padded for b in dp.buckets) * 8
    out["hooks"] = len(dp.reducer.handles)
    out["params"] = sum(len(b.params) for b in dp.buckets)
    out["last_params"] = len(dp.buckets[-1].params)
    return out


def test_no_communication_during_accumulation_and_grads_are_bucket_views() -> None:
    got = run_distributed(_comm_worker, 2)[0]
    assert got[0] == 0  # the grad_sync(False) microbatch sent nothing
    assert got["buckets"] > 1 and got["views"]
    one_all_reduce = 2 * (2 - 1) / 2  # bytes sent per byte reduced, 2 ranks
    # Every bucket but the last is launched by its hooks during the backward; the last
    # (the first layers, no hooks) as the grad_sync round ends. Each is reduced once.
    assert got["hooks"] == got["params"] - got["last_params"]
    assert got[1] == pytest.approx(one_all_reduce * got["bytes"])
    assert got["total"] == got[1]


def _second_backward_worker(rank: int, world: int) -> str:
    from partita.errors import PartitaError

    mesh = Mesh(Layout(dp=world), rank, world)
    dp = DataParallel(zp.make_model({}, torch.float64), mesh,
                      precision=MixedPrecision(param_dtype=torch.float64))
    assert len(dp.buckets) == 1 and not dp.reducer.handles  # one bucket: no hooks at all
    tokens = zp.batch(0).chunk(world)[rank]
    dp.backward(zp.lm_loss(dp.module(tokens[:, :-1]), tokens))
    try:
        dp.backward(zp.lm_loss(dp.module(tokens[:, :-1]), tokens))
    except PartitaError as exc:
        return str(exc)
    return "no error"


def test_second_backward_is_refused_on_many_ranks_without_hooks_too() -> None:
    """A hook-free bucket cannot see a late gradient, so DataParallel.backward refuses
    a second backward in a round that synchronises, as on one rank."""
    for message in run_distributed(_second_backward_worker, 2):
        assert "grad_sync" in message, message


def _raw_backward_worker(rank: int, world: int, stage: int) -> float:
    import copy

    import torch.distributed as dist

    mesh = Mesh(Layout(dp=world), rank, world)
    model = zp.make_model({}, torch.float64)
    plain = copy.deepcopy(model)
    dp = DataParallel(model, mesh, zero=ZeroConfig(stage=stage),
                      precision=MixedPrecision(param_dtype=torch.float64))
    (buf,) = dp.buckets
    tokens = zp.batch(0).chunk(world)[rank]
    for step in range(2):  # the second step checks that a reduced step is not skipped
        zp.lm_loss(dp.module(tokens[:, :-1]), tokens).backward()  # not dp.backward
        dp.finish_grad_sync()
        zp.lm_loss(plain(tokens[:, :-1]), tokens).backward()
        # The mean gradient over the ranks, laid out as the flat bucket.
        grads = dict(plain.named_parameters())
        want = torch.zeros(buf.padded, dtype=torch.float64)
        for e in buf.entries:
            want[e.offset:e.offset + e.numel] = grads[e.name].grad.flatten()
        dist.all_reduce(want)
        want /= world
        lo, hi = (0, buf.padded) if stage == 0 else (buf.lo, buf.hi)
        worst = float((dp._owned_grad(buf) - want[lo:hi]).abs().max())
        assert worst < 1e-12, (step, worst)
        dp.step()  # consumes the reduced gradients: the next boundary reduces again
        dp.wait_params()
        dp.zero_grad()
        plain.load_state_dict({n: p.detach() for n, p in dp.module.named_parameters()})
        plain.zero_grad()
    return worst


@pytest.mark.parametrize("stage", [0, 1])
def test_a_plain_loss_backward_is_reduced_too(stage: int) -> None:
    """loss.backward() on the module, not dp.backward(): the bucket without hooks (here
    the only one) is still reduced at finish_grad_sync, every step."""
    run_distributed(_raw_backward_worker, 2, args=(stage,))
