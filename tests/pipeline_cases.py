"""Shared pieces of the pipeline parity tests: a tiny float64 run through
`build_parallel_model` on every rank, and the single-process reference it must match.

Both sides see the same global batch per step, the same initial weights (drawn from
parameter names) and AdamW with gradient clipping at 1.0, so a correct layout matches
the reference to ~1e-13 in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from partita.config import Config
from partita.mesh import Mesh
from partita.models.transformer import build_model
from partita.parallelize import build_parallel_model

SEQ, VOCAB, LR = 16, 64, 3e-3
MODEL = dict(vocab_size=VOCAB, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)


def make_config(case: dict) -> Config:
    cfg = Config()
    for key, value in {**MODEL, **case.get("model", {})}.items():
        setattr(cfg.model, key, value)
    cfg.data.seq_len = SEQ
    cfg.train.global_batch = case.get("batch", 8)
    cfg.train.microbatches = case.get("m", 4)
    cfg.train.dtype = case.get("dtype", "float64")
    cfg.train.lr = LR
    cfg.parallel.pp = case.get("pp", 1)
    cfg.parallel.tp = case.get("tp", 1)
    cfg.parallel.dp = case.get("dp", 1)
    cfg.parallel.zero_stage = case.get("zero", 0)
    cfg.parallel.schedule = case.get("schedule", "1f1b")
    cfg.parallel.virtual_stages = case.get("v", 1)
    cfg.parallel.sequence_parallel = case.get("sp", False)
    cfg.parallel.bucket_mb = case.get("bucket_mb", 0.01)  # several buckets per stage
    return cfg


def batch(step: int, size: int) -> torch.Tensor:
    """Learnable sequences (next = 5 * token + 3 mod vocab, random starts), so the loss
    falls steadily; uniform random tokens leave only noise, which AdamW amplifies."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.empty(size, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (size,), generator=gen)
    for t in range(SEQ):
        tokens[:, t + 1] = (5 * tokens[:, t] + 3) % VOCAB
    return tokens


def train_case(rank: int, world: int, case: dict, steps: int) -> dict:
    """Run `steps` optimizer steps of `case` on this rank: mean loss and gradient norm
    per step, then the validation loss of one more batch."""
    cfg = make_config(case)
    for key, value in case.get("parallel", {}).items():  # settings not in the config yet
        setattr(cfg.parallel, key, value)
    mesh = Mesh(cfg.layout(world), rank, world)
    pm = build_parallel_model(cfg, mesh, torch.device("cpu"))
    dp, loss_comm = pm.dp, mesh.comm("loss_average")

    def mean(local: float) -> float:
        (total,) = loss_comm.all_reduce_scalars([local])
        (total,) = mesh.comm("pipeline").all_reduce_scalars([total])
        return total / loss_comm.size

    def mine(tokens: torch.Tensor) -> torch.Tensor:
        return tokens.chunk(loss_comm.size)[loss_comm.index]

    losses, norms = [], []
    for step in range(steps):
        tokens = mine(batch(step, cfg.train.global_batch))
        local = pm.runner.train(tokens[:, :-1], tokens[:, 1:], cfg.train.microbatches)
        dp.finish_grad_sync()
        norms.append(dp.clip_grad_norm_(1.0))
        losses.append(mean(local))
        dp.step(LR)
        dp.zero_grad()
    tokens = mine(batch(steps, cfg.train.global_batch))
    val = mean(pm.runner.evaluate(tokens[:, :-1], tokens[:, 1:]))
    held = getattr(pm.runner, "held_peak", {})
    return {"losses": losses, "norms": norms, "val": val, "held": held}


def reference(case: dict, steps: int) -> dict:
    """The same training in one process, no parallelism, whole batch at once."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only add contention
    try:
        return _reference(case, steps)
    finally:
        torch.set_num_threads(threads)


def _reference(case: dict, steps: int) -> dict:
    cfg = make_config(case)
    model_cfg = cfg.model_config()
    dtype = torch.float64 if cfg.train.dtype == "float64" else torch.float32
    model = build_model(model_cfg, dtype=dtype)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    t = cfg.train
    opt = torch.optim.AdamW(groups, lr=LR, betas=(t.beta1, t.beta2), eps=t.eps,
                            weight_decay=t.weight_decay)

    def loss_of(tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    losses, norms = [], []
    for step in range(steps):
        loss = loss_of(batch(step, t.global_batch))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        val = loss_of(batch(steps, t.global_batch)).item()
    return {"losses": losses, "norms": norms, "val": val}


def worst_relative(got: dict, ref: dict) -> float:
    """Largest relative difference over losses, gradient norms and validation loss."""
    pairs = list(zip(got["losses"], ref["losses"])) + list(zip(got["norms"], ref["norms"]))
    pairs.append((got["val"], ref["val"]))
    return max(abs(a - b) / abs(b) for a, b in pairs)


def run_cases(rank: int, world: int, cases: list[dict], steps: int) -> list[dict]:
    return [train_case(rank, world, case, steps) for case in cases]
