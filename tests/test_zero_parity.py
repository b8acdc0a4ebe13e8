"""ZeRO stages 1-3 against one process with the same global batch and initial weights.

Float64 end to end (parameters, master copy, optimizer states): losses over 10 steps,
the gradient norm and the parameters after the last step agree within 1e-10 relative.
Several cases share one spawned world per world size. The helpers here also serve
tests/test_dp.py (stage 0).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from partita.layout import Layout
from partita.mesh import Mesh
from partita.models.config import ModelConfig
from partita.models.transformer import build_model
from partita.testing import run_distributed
from partita.zero import AdamWConfig, DataParallel, MixedPrecision, ZeroConfig, model_init_fn

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
STEPS, BATCH = 10, 8
OPTIM = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TOL = 1e-10


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
    if case.get("model") in TOY_ORDERS:
        torch.manual_seed(0)
        return Toy(recompute=case["model"] == "toy-recompute",
                   order=TOY_ORDERS[case["model"]]).to(dtype)
    return build_model(CFG, device="meta" if meta else "cpu", dtype=dtype)


def batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, CFG.vocab_size, (BATCH, CFG.max_seq_len + 1), generator=gen)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def run_case(rank: int, world: int, mesh: Mesh, case: dict) -> dict | None:
    dtype = getattr(torch, case.get("dtype", "float64"))
    stage, accum = case["stage"], case.get("accum", 1)
    meta = stage == 3 and case.get("model") is None
    model = make_model(case, dtype, meta=meta)
    precision = MixedPrecision(param_dtype=dtype, reduce_dtype=case.get("reduce_dtype"),
                               master_dtype=case.get("master_dtype"))
    dp = DataParallel(model, mesh,
                      zero=ZeroConfig(stage=stage, bucket_mb=case.get("bucket_mb", 0.02),
                                      prefetch=case.get("prefetch", 1),
                                      accumulation=case.get("accumulation", "reduce")),
                      precision=precision, optim=OPTIM, blocks=case.get("blocks"),
                      init_fn=model_init_fn(CFG) if meta else None)
    losses, norms, grads = [], [], None
    for step in range(case.get("steps", STEPS)):
        local = batch(step).chunk(world)[rank]
        total = 0.0
        for m, micro in enumerate(local.chunk(accum)):
            with dp.grad_sync(m == accum - 1):
                loss = lm_loss(dp.module(micro[:, :-1]), micro) / accum
                dp.backward(loss)
            total += loss.item()
        dp.finish_grad_sync()
        if step == 0 and stage == 0:
            grads = {n: p.grad.clone() for n, p in dp.module.named_parameters()}
        norms.append(dp.clip_grad_norm_(case.get("clip", 1.0)))
        dp.step()
        dp.zero_grad()
        losses.append(total)
    loss_t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(loss_t)
    with dp.gathered_parameters():
        params = {n: p.detach().clone() for n, p in dp.module.named_parameters()}
    if rank != 0:
        return None
    # numpy, not torch: tensors would travel back through shared memory that dies with
    # the worker process.
    return {"losses": (loss_t / world).tolist(), "norms": norms,
            "params": {n: _numpy(v) for n, v in params.items()},
            "grads": grads and {n: _numpy(v) for n, v in grads.items()},
            "ledger": dp.memory_ledger()}


def _numpy(t: torch.Tensor):
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()


def worker(rank: int, world: int, cases: list[dict]) -> list[dict | None]:
    mesh = Mesh(Layout(dp=world), rank, world)
    return [run_case(rank, world, mesh, case) for case in cases]


def reference(case: dict) -> dict:
    """One process, the whole global batch, torch.optim.AdamW with the same groups."""
    dtype = getattr(torch, case.get("dtype", "float64"))
    model = make_model(case, dtype)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": OPTIM.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps)
    losses, norms, grads = [], [], None
    for step in range(case.get("steps", STEPS)):
        tokens = batch(step)
        loss = lm_loss(model(tokens[:, :-1]), tokens)
        loss.backward()
        for p in model.parameters():
            # partita's flat buffers give a parameter without a gradient a zero one (so
            # weight decay still applies); torch.optim would skip it.
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        clip = case.get("clip", 1.0)
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            model.parameters(), clip if clip is not None else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def assert_parity(got: dict, ref: dict, tol: float, what: str) -> None:
    assert rel(got["losses"], ref["losses"]) <= tol, (what, got["losses"], ref["losses"])
    assert rel(got["norms"], ref["norms"]) <= tol, (what, got["norms"], ref["norms"])
    for name, value in ref["params"].items():
        assert rel(got["params"][name], value) <= tol, (what, name)
    if got.get("grads") is not None:
        for name, value in ref["grads"].items():
            assert rel(got["grads"][name], value) <= tol, (what, "grad", name)


_REFS: dict[str, dict] = {}


def cached_reference(case: dict) -> dict:
    key = repr(sorted((k, v) for k, v in case.items()
                      if k in ("model", "dtype", "clip", "steps")))
    if key not in _REFS:
        _REFS[key] = reference(case)
    return _REFS[key]


CASES = {
    2: [dict(stage=s, accum=a) for s in (1, 2, 3) for a in (1, 2)]
       + [dict(stage=2, accum=2, accumulation="buffer"),
          dict(stage=3, model="toy", blocks=ToyLayer),
          dict(stage=3, model="toy-recompute", blocks=ToyLayer, accum=2),
          # Gather units of one layer and of all three, blocks run out of order.
          dict(stage=3, model="toy-shuffled", blocks=ToyLayer),
          dict(stage=3, model="toy-shuffled", blocks=ToyLayer, bucket_mb=1.0),
          dict(stage=3, model="toy-recompute", blocks=ToyLayer, bucket_mb=1.0, prefetch=0),
          dict(stage=2, model="toy", blocks="layers.*"),
          # A layer no rank runs: every bucket still reduced (it once was not, when no
          # bucket of a stage-0-2 model completed), its parameters decayed alike.
          *(dict(stage=s, model="toy-unused", blocks=ToyLayer, bucket_mb=1.0)
            for s in (0, 1, 2, 3)),
          dict(stage=3, accum=2, prefetch=2, bucket_mb=1.0)],
    4: [dict(stage=s, accum=a) for s in (1, 2, 3) for a in (1, 2)]
       + [dict(stage=3, dtype="float32", accum=2)],
    8: [dict(stage=3, prefetch=2)],  # 8 ranks x 1 sequence: no room to accumulate
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_zero_matches_single_process(world: int) -> None:
    results = run_distributed(worker, world, args=(CASES[world],), timeout=240)[0]
    for case, got in zip(CASES[world], results):
        fp32 = case.get("dtype") == "float32"
        assert_parity(got, cached_reference(case), 1e-4 if fp32 else TOL, f"{world}:{case}")
