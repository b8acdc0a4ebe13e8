"""Context parallelism on gloo: the ring and all-gather attention Functions against
one process's causal attention (output and every gradient, float64), with the ring's
transfers through shared-memory rings and through gloo, the bytes the ring sends, and
the sharding's load balance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partita.context_parallel import sharding
from partita.context_parallel.allgather import allgather_attention
from partita.context_parallel import ring
from partita.context_parallel.ring import ring_attention
from partita.layout import Layout
from partita.mesh import Mesh
from partita.testing import FLOAT64_TOL, assert_parity, run_distributed

KERNELS = {"ring": ring_attention, "allgather": allgather_attention}
B, H, D, CHUNK = 2, 4, 8, 3  # CHUNK: tokens per chunk, 2c chunks per sequence


def _inputs(seq: int, kv_heads: int):
    gen = torch.Generator().manual_seed(seq * 10 + kv_heads)
    q = torch.randn(B, H, seq, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, seq, D, generator=gen, dtype=torch.float64)
            for _ in range(2))
    return q, k, v, torch.randn(B, H, seq, D, generator=gen, dtype=torch.float64)


def _reference(seq: int, kv_heads: int) -> dict:
    q, k, v, dout = _inputs(seq, kv_heads)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    rep = H // kv_heads
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                         v.repeat_interleave(rep, 1), is_causal=True)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _kernels(rank: int, world: int, shared: bool) -> dict:
    comm = Mesh(Layout(cp=world), rank, world, shm_collectives=shared).comm("context")
    seq = 2 * world * CHUNK
    results = {}
    for kind, fn in KERNELS.items():
        for kv_heads in (H, 2):
            q, k, v, dout = (sharding.shard(t, rank, world, dim=2)
                             for t in _inputs(seq, kv_heads))
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            comm.counter.reset()
            out = fn(q, k, v, comm, D ** -0.5)
            forward_bytes = comm.counter.total("context")
            out.backward(dout)
            results[kind, kv_heads] = {
                "got": {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad},
                "forward_bytes": forward_bytes,
                "backward_bytes": comm.counter.total("context") - forward_bytes,
            }
        # 16-bit inputs: pieces compute in float32, results come back in bfloat16.
        q, k, v, dout = (sharding.shard(t, rank, world, dim=2).to(torch.bfloat16)
                         for t in _inputs(seq, 2))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = fn(q, k, v, comm, D ** -0.5)
        out.backward(dout)
        results[kind, "bf16"] = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    results["rings"] = ring._RINGS.get(comm) is not None
    return results


@pytest.mark.parametrize("shared", [True, False], ids=["rings", "gloo"])
@pytest.mark.parametrize("world", [2, 4])
def test_kernels_match_one_process_in_float64(world: int, shared: bool) -> None:
    ranks = run_distributed(_kernels, world, (shared,))
    seq = 2 * world * CHUNK
    assert [r.pop("rings") for r in ranks] == [shared] * world
    for (kind, kv_heads), _ in ranks[0].items():
        if kv_heads == "bf16":
            ref = _reference(seq, 2)
            for rank in range(world):
                got = ranks[rank][kind, "bf16"]
                assert {t.dtype for t in got.values()} == {torch.bfloat16}
                expected = {name: sharding.shard(t, rank, world, dim=2)
                            for name, t in ref.items()}
                # bfloat16 keeps 8 bits: its inputs alone are rounded by up to 2^-9.
                assert_parity(got, expected, 2e-2, f"{kind} bf16 cp={world} rank {rank}")
            continue
        ref = _reference(seq, kv_heads)
        for rank in range(world):
            expected = {name: sharding.shard(t, rank, world, dim=2) for name, t in ref.items()}
            assert_parity(ranks[rank][kind, kv_heads]["got"], expected, FLOAT64_TOL,
                          f"{kind} cp={world} kv_heads={kv_heads} rank {rank}")
        # Only kv heads travel. Both kinds send (c-1) shards of k and v forward; the
        # backward sends them c-1 more times (ring hops, or a second all-gather) and
        # returns c-1 shards of their gradients (straight to the owners, or a
        # reduce-scatter).
        shard_bytes = 2 * B * kv_heads * (seq // world) * D * 8
        got = ranks[0][kind, kv_heads]
        assert got["forward_bytes"] == (world - 1) * shard_bytes, kind
        assert got["backward_bytes"] == 2 * (world - 1) * shard_bytes, kind


def test_sharding_round_trip_and_balance() -> None:
    x = torch.arange(2 * 4 * 5).view(1, -1)
    for c in (1, 2, 4):
        shards = [sharding.shard(x, r, c) for r in range(c)]
        if c > 1:
            assert torch.equal(sharding.unshard(shards), x)
            for r, s in enumerate(shards):
                assert torch.equal(sharding.positions(r, c, s.shape[1]), s[0])
        # Causal work per rank (query-key pairs) is the same on every rank.
        work = {int((s[0][:, None] >= x[0][None, :]).sum()) for s in shards}
        assert len(work) == 1, (c, work)


def test_a_plan_without_attention_cores_is_refused() -> None:
    import dataclasses

    from partita.comm import CommCounter, GroupComm
    from partita.context_parallel import apply_context_parallel
    from partita.errors import PartitaError
    from partita.models import plan as roles
    from partita.models.model_config import ModelConfig
    from partita.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4))
    plan = model.plan()
    bare = dataclasses.replace(plan, roles={k: r for k, r in plan.roles.items()
                                            if r != roles.ATTENTION_CORE})
    comm = GroupComm(None, [0, 1], 0, "context", CommCounter())
    with pytest.raises(PartitaError, match="names none"):
        apply_context_parallel(model, bare, comm, "ring")
    assert apply_context_parallel(model, plan, comm, "ring") == ["blocks.0.attn.core"]


def _model_bytes(rank: int, world: int) -> dict:
    from partita.parallelize import build_parallel_model
    from partita.testing import parity_config, token_batch

    out = {}
    for kind in KERNELS:
        cfg = parity_config(parallel=dict(cp=world, cp_kind=kind), train=dict(microbatches=2))
        mesh = Mesh(cfg.layout(world), rank, world)
        pm = build_parallel_model(cfg, mesh, torch.device("cpu"))
        tokens = token_batch(0, 8, 16, 64)
        mesh.counter.reset()
        pm.runner.train(tokens[:, :-1], tokens[:, 1:], 2)
        train = mesh.counter.total("context")
        pm.runner.evaluate(tokens[:, :-1], tokens[:, 1:])
        out[kind] = {"train": train, "evaluate": mesh.counter.total("context") - train}
    return out


def test_a_training_step_sends_the_stated_bytes_per_layer_and_microbatch() -> None:
    # The parity model: 2 layers, 2 kv heads of width 8, float64; 8 sequences of 16
    # tokens in 2 microbatches of 4. One shard of keys and values: 2*b*(s/c)*h_kv*d*e.
    c, layers, microbatches = 2, 2, 2
    shard = 2 * 4 * (16 // c) * 2 * 8 * 8
    per_layer = {"ring": 3 * (c - 1), "allgather": 3 * (c - 1)}
    for ranks in run_distributed(_model_bytes, c):
        for kind, got in ranks.items():
            assert got["train"] == layers * microbatches * per_layer[kind] * shard, kind
            # Validation: forward only, the whole batch at once (b = 8).
            assert got["evaluate"] == layers * (c - 1) * 2 * shard, kind
