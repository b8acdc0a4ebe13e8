"""Tensor parallelism without processes: split arithmetic, layout validation, errors,
dropout generators, and what apply_tensor_parallel reports on a tp=1 comm."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from partita.errors import PartitaError
from partita.layout import Layout
from partita.layout_rules import find_problems
from partita.mesh import Mesh
from partita.models.model_config import ModelConfig
from partita.models.transformer import build_model
from partita.sharding import shard_info
from partita.tensor_parallel import apply_tensor_parallel
from partita.tensor_parallel import partition as part
from partita.tensor_parallel.dropout import RegionRNG


def test_padded_split_covers_every_row_once() -> None:
    for n in range(1, 40):
        for tp in range(1, 9):
            if part.padded_split(n, tp, tp - 1)[0] >= n and tp > 1:
                with pytest.raises(PartitaError, match="Use a tp degree"):
                    part.check_padded_split(n, tp, "x")
                continue
            pieces = [part.padded_split(n, tp, i) for i in range(tp)]
            assert pieces[0][0] == 0 and pieces[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
            assert all(stop - start == -(-n // tp) for start, stop in pieces[:-1])


def test_head_split_error_names_valid_degrees() -> None:
    assert part.head_split(8, 4, 3) == (6, 8)
    with pytest.raises(PartitaError, match=r"Valid tp degrees: \[1, 2, 3, 6\]"):
        part.head_split(6, 4, 0)


@pytest.mark.parametrize("n_heads,n_kv,tp,expect", [
    (8, 2, 4, [[0], [0], [1], [1]]),  # two ranks share each kv head: compute it once
    (6, 3, 2, [[0, 0, 1], [1, 2, 2]]),  # uneven mapping: one kv head per query head
    (4, 1, 4, [[0]] * 4),  # multi-query attention
])
def test_replicated_kv_rows(n_heads, n_kv, tp, expect) -> None:
    got = [part.kv_rows_for_rank(n_heads, n_kv, *part.head_split(n_heads, tp, r))
           for r in range(tp)]
    assert got == expect


def test_tensor_parallel_rules_live_in_the_layout_validation() -> None:
    """Every tensor-parallel rule is one of partita.layout's (one rule set); the exact
    adjustments (padding, replicated kv heads) are reported when the plan is applied."""
    cfg = ModelConfig(vocab_size=67, dim=64, n_heads=8, n_kv_heads=2, ffn_dim=90)

    def problems(tp, sp=False, seq_len=16, world=None, model=cfg):
        lay = Layout(tp=tp, dp=1, sequence_parallel=sp)
        return " ".join(p.message for p in find_problems(
            lay, model, world or tp, seq_len=seq_len, global_batch=8))

    assert problems(4, sp=True) == ""
    assert "needs 4 processes but 2" in problems(4, world=2)
    assert "parallel.tp=1" in problems(1, sp=True)
    assert re.search(r"seq_len=15 .*\[1, 3, 5, 15\]", problems(2, sp=True, seq_len=15))
    assert "n_heads=8 is not divisible by tp=3" in problems(3)
    assert "last rank" in problems(4, model=ModelConfig(vocab_size=5, dim=64, n_heads=4))


def test_region_rng_rule() -> None:
    """Replicated masks equal across tp ranks; split masks differ (and are reproducible)."""
    draws = {}
    for tp_index in (0, 1):
        rng = RegionRNG(seed=7, tp_index=tp_index)
        for kind in ("replicated", "split"):
            gen = rng.generator(kind, torch.device("cpu"))
            draws[kind, tp_index] = torch.rand(64, generator=gen)
    assert torch.equal(draws["replicated", 0], draws["replicated", 1])
    assert not torch.equal(draws["split", 0], draws["split", 1])
    again = torch.rand(64, generator=RegionRNG(7, 1).generator("split", torch.device("cpu")))
    assert torch.equal(again, draws["split", 1])


def _comm():
    return Mesh(Layout()).comm("tensor")


def test_apply_reports_every_module_and_shard_info() -> None:
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, dropout=0.1)
    model = build_model(cfg, "meta")
    report = apply_tensor_parallel(model, model.plan(), _comm())
    assert report.parallel["blocks.1.attn.wq"] == "ColumnParallelLinear"
    assert report.parallel["blocks.1.mlp.w_down"] == "RowParallelLinear"
    assert report.parallel["output"] == "VocabParallelHead"
    assert "norm.weight" in report.replicated
    for name, p in model.named_parameters():
        assert p.is_meta and shard_info(p).name == name
    assert all(type(m).__name__ != "Dropout" for m in model.modules())


def test_unconverted_planned_module_is_reported() -> None:
    """The classic bug: a planned module silently staying a plain (unsplit) layer."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4)
    model = build_model(cfg, "meta")

    class Custom(nn.Module):  # a projection type tensor parallelism does not know
        def forward(self, x):
            return x

    model.blocks["0"].mlp.w_up = Custom()
    with pytest.raises(PartitaError, match=r"blocks\.0\.mlp\.w_up \(colwise: Custom\)"):
        apply_tensor_parallel(model, model.plan(), _comm())


def test_sequence_parallel_needs_tp() -> None:
    model = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4), "meta")
    with pytest.raises(PartitaError, match="Set parallel.tp to 2 or more"):
        apply_tensor_parallel(model, model.plan(), _comm(), sequence_parallel=True)


def test_applying_twice_is_refused() -> None:
    model = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4), "meta")
    apply_tensor_parallel(model, model.plan(), _comm())
    with pytest.raises(PartitaError, match="already applied"):
        apply_tensor_parallel(model, model.plan(), _comm())


def _fake_comm(tp: int, index: int):
    """A tp-sized comm without processes: applying issues no collective."""
    from partita.comm import CommCounter, GroupComm

    return GroupComm(None, list(range(tp)), index, "tensor", CommCounter())


@pytest.mark.parametrize("tp,model", [
    (4, dict(n_kv_heads=2, vocab_size=67, ffn_dim=90)),
    (2, dict(flavour="gpt2", tie_embeddings=True, vocab_size=67)),
    (8, dict(n_heads=8, n_kv_heads=1, vocab_size=61)),
])
def test_shards_tile_every_global_parameter(tp: int, model: dict) -> None:
    """Over the tp ranks, split shards cover each global parameter exactly once and
    replicated ones are whole; local shapes match their ShardInfo."""
    cfg = ModelConfig(**{**dict(dim=64, n_layers=2, n_heads=4), **model})
    full = dict(build_model(cfg, "meta").named_parameters())
    covered: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for r in range(tp):
        m = build_model(cfg, "meta")
        apply_tensor_parallel(m, m.plan(), _fake_comm(tp, r))
        assert set(dict(m.named_parameters())) == set(full)
        for name, p in m.named_parameters():
            info = shard_info(p)
            assert info.name == name and info.global_shape == tuple(full[name].shape)
            assert tuple(p.shape) == info.local_shape()
            if info.is_split:
                covered.setdefault((name, info.dim), []).append((info.start, info.stop))
            else:
                assert info.replicated_over == ("tensor",)
    for (name, dim), pieces in covered.items():
        pieces.sort()
        assert len(pieces) == tp and pieces[0][0] == 0, name
        assert pieces[-1][1] == full[name].shape[dim], name
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), name


def test_apply_rejects_heads_not_divisible() -> None:
    model = build_model(ModelConfig(vocab_size=64, dim=48, n_layers=1, n_heads=6), "meta")
    with pytest.raises(PartitaError, match=r"Valid tp degrees: \[1, 2, 3, 6\]"):
        apply_tensor_parallel(model, model.plan(), _fake_comm(4, 0))


def test_cross_entropy_bf16_logits_compute_in_fp32() -> None:
    from partita.tensor_parallel import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 64, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(64, (2, 5), generator=gen)
    loss = vocab_parallel_cross_entropy(logits, targets, _comm(), 0, 64)
    want = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    assert loss.dtype == torch.float32 and abs(loss.item() - want.item()) < 1e-6
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("moe_tp", ["experts", "hidden"])
def test_frozen_parameters_stay_frozen(moe_tp: str) -> None:
    """Fine-tuning part of a model: every shard keeps its source's requires_grad, or the
    optimizer trains weights the user froze (split linears, the vocabulary, experts)."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_experts=4,
                      top_k=2, moe_every=2, shared_experts=1)
    model = build_model(cfg)
    frozen = {n for n in dict(model.named_parameters())
              if ".attn." in n or "tok_embeddings" in n or ".experts.w_up" in n
              or ".shared.w_down" in n or n == "norm.weight"}
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    apply_tensor_parallel(model, model.plan(), _fake_comm(2, 1), moe_tp=moe_tp)
    still = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert still == frozen


def test_frozen_experts_stay_frozen_under_expert_parallelism() -> None:
    from partita.comm import CommCounter, GroupComm
    from partita.experts.apply import apply_expert_parallel

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_experts=4, top_k=2,
                      moe_every=1)
    model = build_model(cfg)
    frozen = {n for n in dict(model.named_parameters()) if ".experts.w_up" in n}
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    ep = GroupComm(None, [0, 1], 1, "expert", CommCounter())  # no processes needed
    assert apply_expert_parallel(model, model.plan(), ep) == 2
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen
