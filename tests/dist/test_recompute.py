"""Activation recomputation (partita.memory.recompute) under every layout it must serve.

Float64, a few optimizer steps: each case matches one process within 1e-10 (losses,
gradient norms, validation loss, final weights) through `check_layouts`, and the same
layout without recompute bitwise where the two share a world (dropout cases: masks are
the layout's own, so only the same layout can be compared, and must match exactly).
Covered: ZeRO-3 over dp, tp + sp (full and selective), pipelines under 1F1B, GPipe,
interleaved and zero bubble (whose split backward reruns the block in I and in W),
`recompute_layers`, and dropout drawn again identically. Also: what is saved shrinks
(the SavedTensorMeter), ZeRO-3 gathers no more under recompute than without (the
backward gather serves the rerun), and bad settings fail before any process starts.
"""

from __future__ import annotations

import pytest
import torch

from partita.errors import PartitaError
from partita.layout import Layout, parse_layout
from partita.layout_rules import validate
from partita.memory import RecomputePolicy, apply_recompute
from partita.models.model_config import ModelConfig
from partita.models.transformer import build_model
from partita.saved_tensors import SavedTensorMeter
from partita.testing import (
    FLOAT64_TOL,
    PARITY_MODEL,
    Case,
    assert_parity,
    check_layouts,
    parity_config,
    run_layouts,
    token_batch,
)
from tests.dist.pipeline_cases import pipeline_config

STEPS = 3
DROPOUT = {"dropout": 0.1}


def _case(name: str, cfg, **kw) -> Case:
    return Case(name, cfg, params=True, **kw)


# Pure checks ----------------------------------------------------------------------------

def test_bad_settings_fail_in_the_layout_rules() -> None:
    model = ModelConfig(**PARITY_MODEL)
    with pytest.raises(PartitaError, match="recompute"):
        parse_layout("recompute=some")
    with pytest.raises(PartitaError, match="recompute_layers=-1"):
        Layout(recompute="full", recompute_layers=-1)
    with pytest.raises(PartitaError, match="recomputes nothing"):
        validate(Layout(recompute_layers=1), model, 1, seq_len=16, global_batch=8)
    with pytest.raises(PartitaError, match="at most 1"):
        validate(Layout(pp=2, recompute="full", recompute_layers=2), model, 2, seq_len=16,
                 global_batch=8)
    validate(parse_layout("recompute=selective recompute_layers=1", 1), model, 1,
             seq_len=16, global_batch=8)
    assert "recompute_layers=1" in Layout(recompute="full", recompute_layers=1).describe()


def test_a_model_without_blocks_or_core_is_refused() -> None:
    model = build_model(ModelConfig(**PARITY_MODEL), dtype=torch.float64)
    plan = model.plan()
    without_core = type(plan)(roles={k: v for k, v in plan.roles.items()
                                     if not k.endswith("core")}, shape=plan.shape)
    with pytest.raises(PartitaError, match="names none"):
        apply_recompute(model, without_core, RecomputePolicy("selective"))
    model.blocks.clear()
    with pytest.raises(PartitaError, match="no blocks"):
        apply_recompute(model, plan, RecomputePolicy("full"))


def _saved(mode: str, layers: int = 0) -> tuple[int, float]:
    """(bytes saved for backward, loss) of one forward of the parity model."""
    cfg = ModelConfig(**PARITY_MODEL)
    model = build_model(cfg, dtype=torch.float64)
    report = apply_recompute(model, model.plan(), RecomputePolicy(mode, layers))
    assert len(report.modules) == (0 if mode == "none" else layers or cfg.n_layers)
    tokens = token_batch(0, 4, 16, cfg.vocab_size)
    with SavedTensorMeter(model) as meter:
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return meter.bytes, loss.item()


def test_recompute_saves_less() -> None:
    none, loss = _saved("none")
    selective, loss_s = _saved("selective")
    full, loss_f = _saved("full")
    one, _ = _saved("full", layers=1)
    assert loss == loss_s == loss_f
    # CPU attention is a flash-style kernel: the core's own saves are its log-sum-exp.
    assert selective < none
    assert full < one < selective


# Layouts against one process --------------------------------------------------------------

TWO = [
    _case("dp2-zero3-full", parity_config(parallel=dict(dp=2, zero_stage=3, recompute="full",
                                                        bucket_mb=0.01))),
    _case("tp2-sp-full", parity_config(parallel=dict(tp=2, sequence_parallel=True,
                                                     recompute="full"))),
    _case("tp2-sp-selective", parity_config(parallel=dict(tp=2, sequence_parallel=True,
                                                          recompute="selective"))),
    _case("pp2-1f1b-full", pipeline_config(schedule="1f1b", recompute="full")),
    _case("pp2-gpipe-selective", pipeline_config(schedule="gpipe", recompute="selective")),
    _case("pp2-interleaved-full", pipeline_config(schedule="interleaved-1f1b",
                                                  virtual_stages=2, recompute="full")),
    _case("pp2-zb-h1-full", pipeline_config(schedule="zb-h1", recompute="full")),
    _case("pp2-zb-h1-full-first-block", pipeline_config(schedule="zb-h1", recompute="full",
                                                        recompute_layers=1)),
]


def test_two_ranks_match_one_process() -> None:
    check_layouts(TWO, 2, STEPS, timeout=200)


def _reseed(pm, cfg) -> None:
    """Each case starts from one state of torch's default generator (nn.Dropout's)."""
    torch.manual_seed(0)


def _dropout_pair(name: str, **parallel) -> list[Case]:
    """The same dropout layout with and without recompute (compared with each other)."""
    def make(rc: str):
        if parallel.get("pp", 1) > 1:
            cfg = pipeline_config(model=DROPOUT, recompute=rc, **parallel)
        else:
            cfg = parity_config(model=DROPOUT, parallel=dict(parallel, recompute=rc))
        return _case(f"{name}-{rc}", cfg)
    return [make("none"), make("full"), make("selective")]


def test_dropout_masks_are_drawn_again_identically() -> None:
    """tp + sp (tensor parallelism's region generators) and a zero-bubble pipeline
    (torch's default generator, forwards of later microbatches between a forward and its
    rerun): with recompute the run is bitwise the run without."""
    pairs = (_dropout_pair("tp2-sp", tp=2, sequence_parallel=True)
             + _dropout_pair("pp2-zb", pp=2, schedule="zb-h1"))
    runs = run_layouts(pairs, 2, STEPS, probe=_reseed, timeout=200)
    for i in range(0, len(pairs), 3):
        base = runs[i]
        for other, case in zip(runs[i + 1:i + 3], pairs[i + 1:i + 3]):
            for rank in range(2):
                assert other[rank]["losses"] == base[rank]["losses"], case.id
                assert other[rank]["norms"] == base[rank]["norms"], case.id
                # Parameters equal up to float64 rounding: bitwise on some CPUs; on
                # others (AMD EPYC, AVX2) the embedding's differ in their last bits.
                assert_parity({n: v for n, (_, v) in other[rank]["params"].items()},
                              {n: v for n, (_, v) in base[rank]["params"].items()},
                              FLOAT64_TOL, f"{case.id} rank {rank}")


def test_zero3_recompute_gathers_no_more() -> None:
    """The rerun happens inside backward's own gather of each unit: the bytes ZeRO-3
    moves per step are the same with and without full recompute."""
    def cfg(rc: str):
        return parity_config(parallel=dict(dp=2, zero_stage=3, recompute=rc, bucket_mb=0.01))
    got = run_distributed_counts([cfg("none"), cfg("full")])
    assert got[0] == got[1] and got[0] > 0


def _count_worker(rank: int, world: int, cfgs: list) -> list[int]:
    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model, dims_from_config

    out = []
    for cfg in cfgs:
        mesh = Mesh(dims_from_config(cfg, world), rank, world)
        pm = build_parallel_model(cfg, mesh, torch.device("cpu"))
        tokens = token_batch(0, cfg.train.global_batch, 16, 64).chunk(world)[rank]
        mesh.counter.reset()
        pm.runner.train(tokens[:, :-1], tokens[:, 1:], 1)
        pm.dp.finish_grad_sync()
        out.append(mesh.counter.total("zero_shard"))
    return out


def run_distributed_counts(cfgs: list) -> list[int]:
    from partita.testing import run_distributed

    return run_distributed(_count_worker, 2, args=(cfgs,))[0]
