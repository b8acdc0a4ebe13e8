"""ZeRO composed with tensor parallelism: the clipped global norm is exact.

dp=2 x tp=2 on 4 ranks, stages 1 and 3, float64, clipping at 1.0 on every step: a norm that counted the
tp-replicated norms twice, or missed the other tp rank's shards, changes every update
and so the loss curve. Losses and norms must match one process within 1e-10.
"""

from __future__ import annotations

import test_zero_parity as zp
import torch
import torch.distributed as dist

from partita.mesh import Mesh, ParallelDims
from partita.models.transformer import build_model
from partita.tensor_parallel import apply_tensor_parallel
from partita.testing import run_distributed
from partita.zero import DataParallel, MixedPrecision, ZeroConfig, model_init_fn

STAGES = (1, 3)


def _worker(rank: int, world: int) -> list[dict]:
    mesh = Mesh(ParallelDims(dp=2, tp=2), rank, world)
    out = []
    for stage in STAGES:
        model = build_model(zp.CFG, device="meta", dtype=torch.float64)
        report = apply_tensor_parallel(model, model.plan(), mesh.comm("tensor"), False)
        dp = DataParallel(model, mesh, zero=ZeroConfig(stage=stage, bucket_mb=0.02),
                          precision=MixedPrecision(param_dtype=torch.float64),
                          optim=zp.OPTIM, init_fn=model_init_fn(zp.CFG))
        losses, norms = [], []
        for step in range(zp.STEPS):
            tokens = zp.batch(step).chunk(2)[mesh.index("zero_shard")]
            loss = report.loss_fn(dp.module(tokens[:, :-1]), tokens[:, 1:])
            dp.backward(loss)
            dp.finish_grad_sync()
            norms.append(dp.clip_grad_norm_(1.0))
            dp.step()
            dp.zero_grad()
            t = torch.tensor([loss.item()], dtype=torch.float64)
            dist.all_reduce(t, group=mesh.group("zero_shard"))
            losses.append(t.item() / 2)
        out.append({"losses": losses, "norms": norms})
    return out


def test_zero_with_tensor_parallel_matches_single_process() -> None:
    ref = zp.cached_reference({})
    for rank_result in run_distributed(_worker, 4, timeout=240):
        for stage, got in zip(STAGES, rank_result):
            assert zp.rel(got["losses"], ref["losses"]) <= zp.TOL, stage
            assert zp.rel(got["norms"], ref["norms"]) <= zp.TOL, stage
