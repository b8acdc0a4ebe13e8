"""Tensor / sequence parallelism against one process: losses and gradient norms over 10
AdamW steps, the validation loss after them, and every gradient at the first and last
step (local shards against the same slice of the reference gradient).

float64 must match to 1e-10 relative (a correct layout is ~1e-13 here); one fp32 case
to 1e-4. One spawned world per world size runs all of its cases through
`build_parallel_model`; one more test applies tensor parallelism to a model that already
holds its weights, the other way in (`apply_tensor_parallel` on `build_model`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partita.layout import Layout
from partita.mesh import Mesh
from partita.models.transformer import build_model
from partita.parallelize import ParallelModel
from partita.sharding import shard_info
from partita.tensor_parallel import apply_tensor_parallel
from partita.testing import (
    FLOAT32_TOL,
    FLOAT64_TOL,
    Case,
    assert_parity,
    check_layouts,
    compare_to_reference,
    parity_config,
    reference,
    run_distributed,
    token_batch,
)

STEPS = 10
# Multi-head attention (n_kv_heads unset), a seed of its own.
LLAMA = dict(n_kv_heads=None, seed=3)
GPT2_TIED = dict(LLAMA, flavour="gpt2", tie_embeddings=True, vocab_size=67)


def tp(name: str, model: dict, sp: bool = False, dtype: str = "float64") -> Case:
    train = dict(global_batch=2, lr=1e-2)
    if dtype == "float32":  # at the default rate: see tests/dist/test_zero_parity.py
        train = dict(global_batch=2, dtype=dtype)
    degree = int(name[2])  # "tp2-..."
    cfg = parity_config(model=model, train=train,
                        parallel=dict(tp=degree, sequence_parallel=sp))
    tol = FLOAT32_TOL if dtype == "float32" else FLOAT64_TOL
    return Case(name, cfg, tol=tol, grads_at=(0, STEPS - 1))


CASES = {
    2: [
        tp("tp2-llama", LLAMA),
        tp("tp2-gqa-odd-vocab", {**LLAMA, "n_kv_heads": 2, "vocab_size": 67}),
        tp("tp2-sp-llama", {**LLAMA, "vocab_size": 67}, sp=True),
        tp("tp2-sp-gpt2-tied", GPT2_TIED, sp=True),
        tp("tp2-gpt2-tied", {**GPT2_TIED, "vocab_size": 64}),
        tp("tp2-fp32", LLAMA, dtype="float32"),
        # Explicit attention scores (model.attention): each rank's query heads of a kv
        # head stacked into one GEMM over its own heads.
        tp("tp2-sp-gqa-explicit-attention", {**LLAMA, "n_kv_heads": 2,
                                             "attention": "explicit"}, sp=True),
        # Biases on q, k and v (Qwen2): split with their rows, the bias of a column shard.
        tp("tp2-sp-gqa-qkv-bias", {**LLAMA, "n_kv_heads": 2, "qkv_bias": True}, sp=True),
    ],
    4: [
        tp("tp4-gqa-replicated-kv-odd", {**LLAMA, "n_kv_heads": 2, "vocab_size": 67,
                                         "ffn_dim": 90}),
        tp("tp4-sp-gpt2-tied-mqa", {**GPT2_TIED, "n_kv_heads": 1}, sp=True),
        # Replicated kv heads with their biases: each rank selects its heads' rows.
        tp("tp4-qkv-bias-replicated-kv", {**LLAMA, "n_kv_heads": 2, "qkv_bias": True}),
    ],
}
# The cases whose vocabulary tp does not divide, without SP: their padding is checked.
PADDED = {2: ["tp2-gqa-odd-vocab"], 4: ["tp4-gqa-replicated-kv-odd"]}


def check_padding(pm: ParallelModel, cfg) -> bool:
    """With a vocabulary tp does not divide (and no SP), the padded logit columns are
    -inf and the gathered softmax gives them exactly zero."""
    vocab, comm = cfg.model_config().vocab_size, pm.mesh.comm("tensor")
    if vocab % comm.size == 0 or cfg.parallel.sequence_parallel:
        return False
    tokens = token_batch(0, cfg.train.global_batch, cfg.data.seq_len, vocab)
    with torch.no_grad():
        logits = pm.module(tokens[:, :-1])
        full = logits.new_empty((comm.size * logits.shape[0], *logits.shape[1:]))
        comm.all_gather_flat(full, logits.contiguous())
        full = torch.cat(full.chunk(comm.size), dim=-1)
        assert full.shape[-1] > vocab
        assert torch.isneginf(full[..., vocab:]).all()
        assert full.softmax(-1)[..., vocab:].sum().item() == 0.0
        ref = F.cross_entropy(full[..., :vocab].flatten(0, 1), tokens[:, 1:].flatten())
        ours = pm.loss_fn(logits, tokens[:, 1:])
        assert torch.allclose(ours, ref, rtol=1e-12, atol=0)
    return True


@pytest.mark.parametrize("world", sorted(CASES))
def test_tensor_parallel_matches_single_process(world: int) -> None:
    results = check_layouts(CASES[world], world, STEPS, probe=check_padding, timeout=150)
    padded = [case.id for case, (ranks, _) in zip(CASES[world], results) if ranks[0]["probe"]]
    assert padded == PADDED[world]


def _materialised(rank: int, world: int, cfg) -> dict:
    """One forward and backward of a model built whole, then split by tensor parallelism."""
    comm = Mesh(Layout(tp=world), rank, world).comm("tensor")
    model = build_model(cfg.model_config(), dtype=torch.float64)
    report = apply_tensor_parallel(model, model.plan(), comm, cfg.parallel.sequence_parallel)
    tokens = token_batch(0, cfg.train.global_batch, cfg.data.seq_len,
                         cfg.model_config().vocab_size)
    loss = report.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        info = shard_info(p, name)
        grads[0, info.name] = (info, p.grad.clone())
    return {"losses": [loss.item()], "grads": grads}


def test_splitting_a_model_that_holds_its_weights_matches_single_process() -> None:
    cfg = parity_config(model=GPT2_TIED, parallel=dict(tp=2, sequence_parallel=True),
                        train=dict(global_batch=2))
    ref = reference(cfg, steps=1, grads_at=(0,))
    for rank, got in enumerate(run_distributed(_materialised, 2, args=(cfg,))):
        actual, expected = compare_to_reference(got, ref)
        assert len(actual) == 1 + len(ref["grads"])
        assert_parity(actual, expected, FLOAT64_TOL, f"materialised tp2-sp rank {rank}")
