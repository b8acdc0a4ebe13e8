"""Mixed precision: bf16 tracks the fp32 reference; fp16 overflow skips a step everywhere."""

from __future__ import annotations

import pytest
import torch

from partita.models.transformer import transformer_init
from partita.layout import Layout
from partita.mesh import Mesh
from partita.testing import (
    Case,
    assert_parity,
    parity_config,
    reference,
    run_distributed,
    run_layouts,
)
from partita.zero import DataParallel, MixedPrecision, ZeroConfig, model_init_fn
from tests.dist import dp_cases as zp

# bf16 keeps 8 significant bits (relative rounding up to 2^-9 = 2e-3 per value); 6 steps
# of bf16 forward/backward with fp32 master weights drift the loss from the fp32 run by
# 5.5e-4 (ZeRO-2, fp32 reduction) and 3.8e-4 (ZeRO-3, bf16 reduction) on the harness's
# learnable batches (measured; uniform random tokens drifted 5.5e-3 and 3.9e-3). The
# tolerance stays 2e-2: training on half of each batch (a lost microbatch) moves the
# fp32 loss curve by 4.8e-2, a doubled learning rate by 9.6e-2 (measured).
BF16_LOSS_TOL = 2e-2
STEPS = 6


def _bf16(stage: int, microbatches: int = 1, pp: int = 1, **precision) -> Case:
    cfg = parity_config(parallel=dict(zero_stage=stage, bucket_mb=0.02, pp=pp),
                        precision=dict(param_dtype="bfloat16", **precision),
                        train=dict(microbatches=microbatches, lr=1e-2))
    return Case(f"zero{stage}-pp{pp}-bf16", cfg, tol=BF16_LOSS_TOL)


# fp32 reductions: stage 2 holds fp32 shards; stage 1 and a pipeline's stage 0 (one rank
# per stage: nothing to reduce, but fp32 buckets to accumulate in) hold fp32 buckets.
BF16_CASES = [_bf16(2, microbatches=2, reduce_dtype="float32"), _bf16(3),
              _bf16(1, microbatches=2, reduce_dtype="float32"),
              _bf16(0, microbatches=4, pp=2, reduce_dtype="float32")]


def test_bf16_tracks_fp32() -> None:
    runs = run_layouts(BF16_CASES, 2, STEPS)
    ref = reference(parity_config(train=dict(dtype="float32", lr=1e-2)), STEPS)
    for case, ranks in zip(BF16_CASES, runs):
        got = ranks[0]
        assert_parity({"loss": got["losses"]}, {"loss": ref["losses"]}, case.tol, case.id)
        assert got["ledger"]["master_weights"] > 0  # fp32 master copy of the owned slice


def _snapshot(dp: DataParallel) -> list[torch.Tensor]:
    with dp.gathered_parameters():
        return [p.detach().clone() for p in dp.module.parameters()]


def _fp16_worker(rank: int, world: int, stages: list[int], bad: dict[int, str],
                 max_skips: int) -> list[dict]:
    mesh = Mesh(Layout(dp=world), rank, world)
    out = []
    for stage in stages:
        model = zp.make_model({}, torch.float16, meta=stage == 3)
        dp = DataParallel(model, mesh, zero=ZeroConfig(stage=stage, bucket_mb=0.02),
                          precision=MixedPrecision(param_dtype=torch.float16,
                                                   initial_scale=1024.0, max_skips=max_skips),
                          optim=zp.OPTIM, init_fn=model_init_fn(transformer_init(zp.CFG)) if stage == 3 else None)
        oks, scales, unchanged = [], [], []
        for step in range(6):
            tokens = zp.batch(step).chunk(world)[rank]
            with dp.grad_sync(True):
                loss = zp.lm_loss(dp.module(tokens[:, :-1]).float(), tokens)
                if rank == 1 and bad.get(step) == "loss":
                    loss = loss * float("inf")  # overflow in this rank's backward
                dp.backward(loss)
            dp.finish_grad_sync()
            if rank == 1 and bad.get(step) == "slice":
                # Overflow that only rank 1 can see: inside the gradient slice it owns.
                dp._owned_grad(dp.buckets[0])[0] = float("inf")
            before = _snapshot(dp)
            dp.clip_grad_norm_(1.0)
            oks.append(dp.step())
            unchanged.append(all(torch.equal(a, b) for a, b in zip(before, _snapshot(dp))))
            scales.append(dp.loss_scale)
            dp.zero_grad()
        out.append({"oks": oks, "scales": scales, "unchanged": unchanged})
    return out


def test_fp16_overflow_skips_that_step_on_every_rank() -> None:
    bad = {2: "loss", 4: "slice"}
    results = run_distributed(_fp16_worker, 2, args=([0, 1, 3], bad, 20), timeout=240)
    for rank_result in results:
        for got in rank_result:
            expect = [step not in bad for step in range(6)]
            assert got["oks"] == expect
            assert got["unchanged"] == [not ok for ok in expect]
            assert got["scales"] == [1024.0, 1024.0, 512.0, 512.0, 256.0, 256.0]


def test_repeated_fp16_overflow_stops_with_advice() -> None:
    bad = {step: "loss" for step in range(6)}
    with pytest.raises(RuntimeError, match="overflowed on 3 consecutive steps"):
        run_distributed(_fp16_worker, 2, args=([2], bad, 3), timeout=120)


def _bucket_grads(dp: DataParallel) -> dict[str, torch.Tensor]:
    """What each bucket holds after finish_grad_sync, per parameter name, in the owned
    range (stage 1 reduces only the slice a rank owns)."""
    out = {}
    for buf in dp.buckets:
        lo, hi = dp._owned_range(buf)
        for i, e in enumerate(buf.entries):
            a, b = max(e.offset, lo), min(e.offset + e.numel, hi)
            if a < b:
                out[e.name] = (buf.full_grad[a:b].clone(), a - e.offset, b - e.offset)
    return out


def _fp32_accumulation_worker(rank: int, world: int, stage: int,
                              microbatches: int) -> dict:
    mesh = Mesh(Layout(dp=world), rank, world)
    model = zp.make_model({}, torch.bfloat16)
    ref_model = zp.make_model({}, torch.bfloat16)
    ref_model.load_state_dict(model.state_dict())
    dp = DataParallel(model, mesh, zero=ZeroConfig(stage=stage, bucket_mb=0.02),
                      precision=MixedPrecision(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32),
                      optim=zp.OPTIM)
    ref = dict(ref_model.named_parameters())
    tokens = zp.batch(0).chunk(world)[rank]
    fp32_sum = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref.items()}
    bf16_sum = {n: torch.zeros_like(p) for n, p in ref.items()}
    for k, micro in enumerate(tokens.chunk(microbatches)):
        with dp.grad_sync(k == microbatches - 1):
            dp.backward(zp.lm_loss(dp.module(micro[:, :-1]).float(), micro) / microbatches)
        ref_model.zero_grad()
        (zp.lm_loss(ref_model(micro[:, :-1]).float(), micro) / microbatches).backward()
        for n, p in ref.items():
            fp32_sum[n] += p.grad.float()
            bf16_sum[n] += p.grad
    dp.finish_grad_sync()
    # The mean over ranks of each rank's fp32 sum: what the buckets must hold exactly.
    for n in sorted(fp32_sum):
        fp32_sum[n].mul_(1.0 / world)
        torch.distributed.all_reduce(fp32_sum[n])
    got = _bucket_grads(dp)
    exact = all(torch.equal(g, fp32_sum[n].flatten()[a:b]) for n, (g, a, b) in got.items())
    bf16_differs = any(not torch.equal(bf16_sum[n].float(), fp32_sum[n] * world)
                       for n in fp32_sum)
    dtypes = {str(buf.full_grad.dtype) for buf in dp.buckets}
    grads_bound = any(p.grad is not None for p in model.parameters())
    # Stage 0 without zero_grad: the next backward adds to the reduced gradients, as
    # torch's .grad does, and the buckets then hold the old mean plus the new one. (Stage
    # 1's buckets hold reduced values only in the owned slice, so there, as with bf16
    # buckets, a step needs its zero_grad.)
    micro = zp.batch(1).chunk(world)[rank]
    dp.backward(zp.lm_loss(dp.module(micro[:, :-1]).float(), micro))
    dp.finish_grad_sync()
    ref_model.zero_grad()
    zp.lm_loss(ref_model(micro[:, :-1]).float(), micro).backward()
    new_mean = {n: ref[n].grad.float() / world for n in sorted(ref)}
    for n in sorted(new_mean):  # every rank, every name, in the same order
        torch.distributed.all_reduce(new_mean[n])
    added = all(torch.allclose(g, (fp32_sum[n] + new_mean[n]).flatten()[a:b],
                               rtol=1e-5, atol=1e-7)
                for n, (g, a, b) in _bucket_grads(dp).items())
    # The step reads those fp32 gradients; it must still train.
    dp.clip_grad_norm_(1.0)
    dp.step()
    dp.zero_grad()
    return {"exact": exact, "bf16_differs": bf16_differs, "dtypes": dtypes,
            "grads_bound": grads_bound, "named": len(got), "added": added}


@pytest.mark.parametrize("stage", [0, 1])
def test_stages_0_1_accumulate_bf16_gradients_in_fp32(stage: int) -> None:
    """bf16 parameters with fp32 reductions: stages 0-1 hold their buckets in fp32, and
    after 4 microbatches they hold exactly the rank mean of each rank's fp32 sum of its
    bf16 microbatch gradients (the bf16 sums differ from those, so bf16 buckets fail)."""
    results = run_distributed(_fp32_accumulation_worker, 2, args=(stage, 4), timeout=240)
    for got in results:
        assert got["dtypes"] == {"torch.float32"}
        assert got["exact"]
        assert got["bf16_differs"]
        assert not got["grads_bound"]  # a bf16 .grad cannot view an fp32 bucket
        if stage == 0:
            assert got["added"]
        assert got["named"] > 0
