"""Shared pieces of the tests that drive `partita.zero.DataParallel` directly, below
`build_parallel_model`: a toy model outside partita's catalog, the parity model built
by hand, and a DataParallel training loop with its plain-PyTorch reference.

Layouts of catalog models go through `partita.testing` instead; these tests keep the
lower-level API because the engine must also serve models partita did not write
(any block class, blocks run out of order or not at all, activation checkpointing).
Both use the harness's batch maker and `assert_parity`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from partita.layout import Layout
from partita.mesh import Mesh
from partita.models.model_config import ModelConfig
from partita.models.transformer import build_model, transformer_init
from partita.testing import PARITY_MODEL, token_batch
from partita.zero import AdamWConfig, DataParallel, MixedPrecision, ZeroConfig, model_init_fn

CFG = ModelConfig(**PARITY_MODEL)
STEPS, BATCH = 10, 8
OPTIM = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class ToyLayer(nn.Module):
    """A residual MLP layer of a model that is not in partita's catalog."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Toy(nn.Module):
    def __init__(self, recompute: bool = False, order: tuple[int, ...] = (0, 1, 2)) -> None:
        super().__init__()
        self.recompute, self.order = recompute, order
        self.emb = nn.Embedding(CFG.vocab_size, 24)
        self.layers = nn.ModuleList([ToyLayer(24) for _ in range(3)])
        self.head = nn.Linear(24, CFG.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in (self.layers[i] for i in self.order):
            if self.recompute:  # activation checkpointing: forward runs again in backward
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.head(h)


# toy-shuffled runs its layers out of registration order, one of them twice; toy-unused
# never runs its middle layer (its parameters get no gradient on any rank).
TOY_ORDERS = {"toy": (0, 1, 2), "toy-recompute": (0, 1, 2), "toy-shuffled": (2, 0, 1, 0),
              "toy-unused": (0, 2)}


def make_model(case: dict, dtype: torch.dtype, meta: bool = False) -> nn.Module:
    """The toy model named by case["model"], else the parity model (on meta if asked)."""
    if case.get("model") in TOY_ORDERS:
        torch.manual_seed(0)
        return Toy(recompute=case["model"] == "toy-recompute",
                   order=TOY_ORDERS[case["model"]]).to(dtype)
    return build_model(CFG, device="meta" if meta else "cpu", dtype=dtype)


def batch(step: int) -> torch.Tensor:
    """Step `step`'s global batch: the harness's batch maker at this module's sizes."""
    return token_batch(step, BATCH, CFG.max_seq_len, CFG.vocab_size)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def run_case(rank: int, world: int, mesh: Mesh, case: dict) -> dict | None:
    """Train `case` under DataParallel; rank 0 returns losses, norms and parameters."""
    dtype = getattr(torch, case.get("dtype", "float64"))
    stage, accum = case["stage"], case.get("accum", 1)
    meta = stage == 3 and case.get("model") is None
    model = make_model(case, dtype, meta=meta)
    dp = DataParallel(model, mesh,
                      zero=ZeroConfig(stage=stage, bucket_mb=case.get("bucket_mb", 0.02),
                                      prefetch=case.get("prefetch", 1),
                                      keep_gathered=case.get("keep_gathered", 1)),
                      precision=MixedPrecision(param_dtype=dtype), optim=OPTIM,
                      blocks=case.get("blocks"), init_fn=model_init_fn(transformer_init(CFG)) if meta else None)
    losses, norms = [], []
    for step in range(STEPS):
        local = batch(step).chunk(world)[rank]
        total = 0.0
        for m, micro in enumerate(local.chunk(accum)):
            with dp.grad_sync(m == accum - 1):
                loss = lm_loss(dp.module(micro[:, :-1]), micro) / accum
                dp.backward(loss)
            total += loss.item()
        dp.finish_grad_sync()
        norms.append(dp.clip_grad_norm_(1.0))
        dp.step()
        dp.zero_grad()
        losses.append(total)
    loss_t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(loss_t)
    with dp.gathered_parameters():
        params = {n: p.detach().clone() for n, p in dp.module.named_parameters()}
    if rank != 0:
        return None
    return as_quantities((loss_t / world).tolist(), norms, params)


def worker(rank: int, world: int, cases: list[dict]) -> list[dict | None]:
    mesh = Mesh(Layout(dp=world), rank, world)
    return [run_case(rank, world, mesh, case) for case in cases]


def as_quantities(losses: list[float], norms: list[float], params: dict) -> dict:
    """The names `assert_parity` compares, as the harness names them."""
    return {"loss": losses, "grad norm": norms,
            **{f"param {n}": v for n, v in params.items()}}


def reference(case: dict) -> dict:
    """One process, the whole global batch, torch.optim.AdamW with the same groups."""
    model = make_model(case, getattr(torch, case.get("dtype", "float64")))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": OPTIM.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps)
    losses, norms = [], []
    for step in range(STEPS):
        tokens = batch(step)
        loss = lm_loss(model(tokens[:, :-1]), tokens)
        loss.backward()
        for p in model.parameters():
            # partita's flat buffers give a parameter without a gradient a zero one (so
            # weight decay still applies); torch.optim would skip it.
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return as_quantities(losses, norms,
                         {n: p.detach().clone() for n, p in model.named_parameters()})
