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


def _bf16(stage: int, microbatches: int = 1, **precision) -> Case:
    cfg = parity_config(parallel=dict(zero_stage=stage, bucket_mb=0.02),
                        precision=dict(param_dtype="bfloat16", **precision),
                        train=dict(microbatches=microbatches, lr=1e-2))
    return Case(f"zero{stage}-bf16", cfg, tol=BF16_LOSS_TOL)


BF16_CASES = [_bf16(2, microbatches=2, reduce_dtype="float32"), _bf16(3)]


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
