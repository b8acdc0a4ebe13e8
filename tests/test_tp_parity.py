"""Tensor / sequence parallelism against one process: losses over 10 AdamW steps and
every gradient (local shards compared with the same slice of the reference gradient).

float64 must match to 1e-10 relative (a correct layout is ~1e-13 here); one fp32 case
to 1e-4. One spawned world per world size runs all of its cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partita.layout import Layout
from partita.mesh import Mesh
from partita.models.config import ModelConfig
from partita.models.transformer import build_model
from partita.sharding import init_shard, set_shard_info, shard_info
from partita.tensor_parallel import apply_tensor_parallel
from partita.testing import run_distributed

STEPS, BATCH, SEQ = 10, 2, 16

LLAMA = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=SEQ, seed=3)
CASES = {
    2: [
        dict(id="tp2-llama", model=LLAMA),
        dict(id="tp2-gqa-odd-vocab-meta", model={**LLAMA, "n_kv_heads": 2, "vocab_size": 67},
             meta=True, check_padding=True),
        dict(id="tp2-sp-llama", model={**LLAMA, "vocab_size": 67}, sp=True),
        dict(id="tp2-sp-gpt2-tied", model={**LLAMA, "flavour": "gpt2", "tie_embeddings": True,
                                          "vocab_size": 67}, sp=True),
        dict(id="tp2-gpt2-tied", model={**LLAMA, "flavour": "gpt2", "tie_embeddings": True}),
        dict(id="tp2-fp32", model=LLAMA, dtype=torch.float32),
    ],
    4: [
        dict(id="tp4-gqa-replicated-kv-odd", model={**LLAMA, "n_kv_heads": 2, "vocab_size": 67,
                                                   "ffn_dim": 90}, check_padding=True),
        dict(id="tp4-sp-gpt2-tied-mqa-meta", model={**LLAMA, "flavour": "gpt2",
                                                   "tie_embeddings": True, "n_kv_heads": 1,
                                                   "vocab_size": 67}, sp=True, meta=True),
    ],
}


def _batches(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(vocab, (BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]


def _tp_model(cfg: ModelConfig, case: dict, comm, dtype: torch.dtype):
    if case.get("meta"):
        model = build_model(cfg, "meta", dtype)
        report = apply_tensor_parallel(model, model.plan(), comm, case.get("sp", False))
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                # build_model draws in fp32 then casts; do the same to start identically.
                value = torch.nn.Parameter(init_shard(cfg, shard_info(p)).to(dtype))
                set_shard_info(value, shard_info(p))
                setattr(module, name, value)
        return model, report
    model = build_model(cfg, dtype=dtype)
    return model, apply_tensor_parallel(model, model.plan(), comm, case.get("sp", False))


def _check_padding(model, report, comm, tokens) -> None:
    """Padded logit columns are -inf; the gathered softmax gives them exactly zero."""
    with torch.no_grad():
        logits = model(tokens[:, :-1])
        full = logits.new_empty((comm.size * logits.shape[0], *logits.shape[1:]))
        comm.all_gather_flat(full, logits.contiguous())
        full = torch.cat(full.chunk(comm.size), dim=-1)
        assert full.shape[-1] == report.padded_vocab_size > report.vocab_size
        assert torch.isneginf(full[..., report.vocab_size:]).all()
        assert full.softmax(-1)[..., report.vocab_size:].sum().item() == 0.0
        ref = F.cross_entropy(full[..., :report.vocab_size].flatten(0, 1),
                              tokens[:, 1:].flatten())
        ours = report.loss_fn(logits, tokens[:, 1:])
        assert torch.allclose(ours, ref, rtol=1e-12, atol=0)


def _run_case(rank: int, world: int, case: dict) -> dict:
    dtype = case.get("dtype", torch.float64)
    cfg = ModelConfig(**case["model"])
    comm = Mesh(Layout(tp=world), rank, world).comm("tensor")
    model, report = _tp_model(cfg, case, comm, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grads = [], {}
    batches = _batches(cfg.vocab_size)
    if case.get("check_padding"):
        _check_padding(model, report, comm, batches[0])
    for step, tokens in enumerate(batches):
        opt.zero_grad()
        loss = report.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
        if step in (0, STEPS - 1):
            for name, p in model.named_parameters():
                # numpy: torch tensors would cross the result queue as shared memory
                # that vanishes when the rank exits.
                grads[(step, name)] = (shard_info(p), p.grad.detach().numpy().copy())
        opt.step()
    return {"losses": losses, "grads": grads}


def _worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [_run_case(rank, world, case) for case in cases]


def _reference(case: dict) -> dict:
    dtype = case.get("dtype", torch.float64)
    cfg = ModelConfig(**case["model"])
    model = build_model(cfg, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    params = dict(model.named_parameters())
    losses, grads = [], {}
    for step, tokens in enumerate(_batches(cfg.vocab_size)):
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        if step in (0, STEPS - 1):
            grads.update({(step, n): params[n].grad.clone() for n in params})
        opt.step()
    return {"losses": losses, "grads": grads}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    # The floor matters for gradients that are zero in exact arithmetic (the key bias:
    # softmax ignores a constant added to every score), where both sides are ~1e-19.
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()


@pytest.mark.parametrize("world", sorted(CASES))
def test_tensor_parallel_matches_single_process(world: int) -> None:
    results = run_distributed(_worker, world, args=(CASES[world],), timeout=120)
    for i, case in enumerate(CASES[world]):
        tol = 1e-4 if case.get("dtype") == torch.float32 else 1e-10
        ref = _reference(case)
        for rank in range(world):
            got = results[rank][i]
            rel = _rel(torch.tensor(got["losses"]), torch.tensor(ref["losses"]))
            assert rel < tol, f"{case['id']} rank {rank}: losses differ by {rel:.2e}"
            assert {n for _, n in got["grads"]} == {n for _, n in ref["grads"]}
            for key, (info, grad) in got["grads"].items():
                want = ref["grads"][key]
                if info.is_split:
                    want = want.narrow(info.dim, info.start, info.stop - info.start)
                rel = _rel(torch.from_numpy(grad), want)
                assert rel < tol, f"{case['id']} rank {rank} {key}: grad differs by {rel:.2e}"
