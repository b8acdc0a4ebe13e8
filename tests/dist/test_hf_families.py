"""A Qwen2 folder (Llama plus biases on q, k and v) imported at tp=2 with sequence
parallelism, ZeRO-3, pp=2 and cp=2 gives transformers' logits and loss (float64, 1e-10):
the biases are split with their projections' rows, gathered by ZeRO-3 and permuted for
partita's rotary pairs on every rank's slice. Trained 5 steps at tp=2 with sequence
parallelism and exported, it continues in transformers' Qwen2ForCausalLM with the same
loss, so the biases' gradients are right too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from partita.export import export_hf
from partita.mesh import Mesh
from partita.parallelize import build_parallel_model, dims_from_config
from partita.testing import FLOAT64_TOL, assert_parity, run_distributed, token_batch
from partita.weights import full_state_dict
from tests.dist.test_hf_import import BATCH, SEQ, VOCAB, _hf_loss, _logits, _mean_loss, import_config

hf_models = pytest.importorskip("tests.hf_models")

LAYOUTS = {
    "tp2-sp": dict(tp=2, sequence_parallel="true"),
    "dp2-zero3": dict(dp=2, zero_stage=3, bucket_mb=0.001),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
}


def _each_layout_then_train(rank: int, world: int, folder: str, tokens: torch.Tensor,
                            later: torch.Tensor, out: str) -> dict:
    got = {}
    for name, parallel in LAYOUTS.items():
        cfg = import_config(folder, **parallel)
        pm = build_parallel_model(cfg, Mesh(dims_from_config(cfg, world), rank, world),
                                  torch.device("cpu"))
        got[name] = {"logits": _logits(pm, tokens[:, :-1]), "loss": _mean_loss(pm, tokens)}
    cfg = import_config(folder, **LAYOUTS["tp2-sp"])
    pm = build_parallel_model(cfg, Mesh(dims_from_config(cfg, world), rank, world),
                              torch.device("cpu"))
    got["trained loss"] = _mean_loss(pm, later, train_steps=5, lr=3e-3)
    state = full_state_dict(pm)
    if rank == 0:
        export_hf(state, cfg.model_config(), out)
    return got


def test_imported_qwen2_matches_transformers_and_trains_at_tp2(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "qwen2", family="qwen2")
    tokens, later = token_batch(99, BATCH, SEQ, VOCAB), token_batch(5, BATCH, SEQ, VOCAB)
    out = tmp_path / "trained"
    ranks = run_distributed(_each_layout_then_train, 2,
                            args=(str(folder), tokens, later, str(out)), timeout=240)
    want_logits = hf_models.hf_logits(folder, tokens[:, :-1])
    want = {"loss": _hf_loss(want_logits, tokens)}
    for name in LAYOUTS:
        for rank, got in enumerate(ranks):
            actual, expected = {"loss": got[name]["loss"]}, dict(want)
            if got[name]["logits"] is not None:
                actual["logits"], expected["logits"] = got[name]["logits"], want_logits
            assert_parity(actual, expected, FLOAT64_TOL, f"{name} rank {rank}")
    assert json.loads((Path(out) / "config.json").read_text())["model_type"] == "qwen2"
    before = _hf_loss(hf_models.hf_logits(folder, later[:, :-1]), later)
    after = _hf_loss(hf_models.hf_logits(out, later[:, :-1]), later)
    assert_parity({"loss": after}, {"loss": ranks[0]["trained loss"]}, FLOAT64_TOL, "continued")
    assert after < before - 1e-3, "five steps of training did not change the loss"
