"""Packed documents at every layout: attention masked to each document and the targets
that start a document not trained (so ranks and microbatches hold unequal numbers of
trained targets). dp with ZeRO-3 and two microbatches, tp=2 with sequence parallelism
and selective recompute, pp=2 (1F1B, two microbatches), and cp=2 with the ring and
all-gather kinds each train exactly like one process (losses, gradient norms,
validation loss and final weights, float64 within 1e-10); the mask and the weighting
each change the loss, so the comparison can fail."""

from __future__ import annotations

import torch

from partita.config import load_config
from partita.data.sampler import IGNORE_INDEX
from partita.mesh import Mesh
from partita.models.documents import document_ids
from partita.parallelize import build_parallel_model, dims_from_config
from partita.testing import FLOAT64_TOL, PARITY_MODEL, assert_parity, run_distributed, token_batch
from partita.weights import full_state_dict

END, SEQ, BATCH, STEPS = 5, 16, 4, 2
LAYOUTS = {
    "dp2-zero3-m2": dict(zero_stage=3, bucket_mb=0.001),
    "tp2-sp-selective": dict(tp=2, sequence_parallel=True, recompute="selective"),
    "pp2": dict(pp=2),
    "cp2-ring": dict(cp=2, cp_kind="ring"),
    "cp2-allgather": dict(cp=2, cp_kind="allgather"),
}


def _config(parallel: dict, microbatches: int = 1):
    model = [f"--model.{k}={v}" for k, v in PARITY_MODEL.items()]
    return load_config(None, model + [
        "--train.dtype=float64", f"--data.seq_len={SEQ}", f"--train.global_batch={BATCH}",
        f"--train.microbatches={microbatches}",
        *[f"--parallel.{k}={v}" for k, v in parallel.items()]])


def _batch(step: int) -> torch.Tensor:
    """Rows of several documents: every fifth token (shifted per row) ends one."""
    tokens = token_batch(step, BATCH, SEQ, PARITY_MODEL["vocab_size"])
    cols = torch.arange(SEQ + 1)
    for r in range(BATCH):
        tokens[r, (cols + 2 * r) % 5 == 4] = END
    return tokens


def _train(rank: int, world: int, parallel: dict, mask: bool = True,
           weigh: bool = True, microbatches: int = 0) -> dict:
    two = parallel.get("pp", 1) > 1 or parallel.get("zero_stage", 0) > 0
    cfg = _config(parallel, microbatches=microbatches or (2 if two else 1))
    mesh = Mesh(dims_from_config(cfg, world), rank, world)
    pm = build_parallel_model(cfg, mesh, torch.device("cpu"))
    data, pipe = mesh.comm("loss_average"), mesh.comm("pipeline")

    def mean(local: float) -> float:
        (total,) = pipe.all_reduce_scalars(data.all_reduce_scalars([local]))
        return total / data.size

    def mine(step: int):
        t = _batch(step)
        x, y = t[:, :-1], t[:, 1:].clone()
        y[x == END] = IGNORE_INDEX  # as the sampler marks a document's first target
        per_rank = int((y != IGNORE_INDEX).sum()) / data.size if weigh else None
        rows = mesh.comm("data")
        x, y = x.chunk(rows.size)[rows.index], y.chunk(rows.size)[rows.index]
        return x, y, (document_ids(x, END) if mask else None), per_rank

    out = {"losses": [], "norms": []}
    for step in range(STEPS):
        x, y, segments, per_rank = mine(step)
        out["losses"].append(mean(pm.runner.train(x, y, cfg.train.microbatches, segments,
                                                  per_rank)))
        pm.dp.finish_grad_sync()
        out["norms"].append(pm.dp.clip_grad_norm_(None))
        pm.dp.step(1e-2)
        pm.dp.zero_grad()
    x, y, segments, per_rank = mine(STEPS)
    out["val"] = mean(pm.runner.evaluate(x, y, segments, per_rank))
    out["state"] = full_state_dict(pm)
    return out


def _every_layout(rank: int, world: int) -> dict:
    return {name: _train(rank, world, parallel) for name, parallel in LAYOUTS.items()}


def test_document_mask_trains_alike_at_every_layout():
    ranks = run_distributed(_every_layout, 2, timeout=240)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = _train(0, 1, {})
        unmasked = _train(0, 1, {}, mask=False)
        unweighted = _train(0, 1, {}, weigh=False, microbatches=2)
    finally:
        torch.set_num_threads(threads)
    assert abs(unmasked["losses"][0] - ref["losses"][0]) > 1e-4
    # Without the weighting two microbatches average their own means: not the mean.
    assert abs(unweighted["losses"][0] - ref["losses"][0]) > 1e-6
    want = {"loss": ref["losses"], "grad norm": ref["norms"], "val": ref["val"],
            **{f"param {k}": v for k, v in ref["state"].items()}}
    for name in LAYOUTS:
        for rank, run in enumerate(ranks):
            got = {"loss": run[name]["losses"], "grad norm": run[name]["norms"],
                   "val": run[name]["val"]}
            if rank == 0:
                got.update({f"param {k}": v for k, v in run[name]["state"].items()})
            expected = {k: want[k] for k in got}
            assert_parity(got, expected, FLOAT64_TOL, f"{name} rank {rank}")
