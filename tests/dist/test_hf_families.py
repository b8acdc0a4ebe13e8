"""Qwen2 and Mixtral folders imported at several layouts give transformers' logits and
loss (float64, 1e-10), every rank having read only its own slices; trained 5 steps and
exported, each continues in transformers with the same loss, and `partita export` of
the checkpoint the training layout wrote gives the same folder.

Qwen2 (Llama plus biases on q, k and v) at tp=2 with sequence parallelism, ZeRO-3, pp=2
and cp=2: the biases are split with their projections' rows, gathered by ZeRO-3 and
permuted for partita's rotary pairs on every rank's slice. Mixtral (every MLP a mixture
of experts, one file tensor per expert where partita stacks them) with the experts on
their own ranks (ep=2, also under ZeRO-3), sharded by ZeRO-3 in flat ranges, split over
tp whole or by width, and in a pipeline stage."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from partita.export import export_hf, export_run
from partita.mesh import Mesh
from partita.models.hf_weights import HFWeights
from partita.parallelize import build_parallel_model, dims_from_config
from partita.testing import FLOAT64_TOL, assert_parity, run_distributed, token_batch
from partita.weights import full_state_dict
from tests.dist.test_hf_import import (
    BATCH,
    SEQ,
    VOCAB,
    _hf_loss,
    _logits,
    _mean_loss,
    _same_folder,
    _save_checkpoint,
    import_config,
)

hf_models = pytest.importorskip("tests.hf_models")

LAYOUTS = {
    "tp2-sp": dict(tp=2, sequence_parallel="true"),
    "dp2-zero3": dict(dp=2, zero_stage=3, bucket_mb=0.001),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
}


def _each_layout_then_train(rank: int, world: int, folder: str, tokens: torch.Tensor,
                            later: torch.Tensor, out: str, layouts: dict[str, dict],
                            train_in: str) -> dict:
    got = {}
    for name, parallel in layouts.items():
        cfg = import_config(folder, **parallel)
        with _expert_reads() as reads:
            pm = build_parallel_model(cfg, Mesh(dims_from_config(cfg, world), rank, world),
                                      torch.device("cpu"))
        got[name] = {"logits": _logits(pm, tokens[:, :-1]), "loss": _mean_loss(pm, tokens),
                     "expert reads": reads}
    cfg = import_config(folder, **layouts[train_in])
    pm = build_parallel_model(cfg, Mesh(dims_from_config(cfg, world), rank, world),
                              torch.device("cpu"))
    got["trained loss"] = _mean_loss(pm, later, train_steps=5, lr=3e-3)
    _save_checkpoint(pm, cfg, f"{out}-checkpoints", rank, world, 5)
    state = full_state_dict(pm)
    if rank == 0:
        export_hf(state, cfg.model_config(), out)
    return got


@contextlib.contextmanager
def _expert_reads():
    """The (first, last + 1) expert ranges the import reads tensor data of."""
    reads: set[tuple[int, int]] = set()
    original = HFWeights._experts

    def recording(self, name, lo, hi, *args, **kwargs):
        reads.add((lo, hi))
        return original(self, name, lo, hi, *args, **kwargs)

    HFWeights._experts = recording
    try:
        yield reads
    finally:
        HFWeights._experts = original


# Mixtral: experts on their own ranks (ep), sharded by ZeRO-3 in flat ranges, split over
# tp whole or by width (parallel.moe_tp), and in a pipeline stage.
MIXTRAL_LAYOUTS = {
    "dp2-ep2": dict(dp=2, ep=2),
    "dp2-ep2-zero3": dict(dp=2, ep=2, zero_stage=3, bucket_mb=0.001),
    "dp2-zero3": dict(dp=2, zero_stage=3, bucket_mb=0.001),
    "tp2-sp-experts": dict(tp=2, sequence_parallel="true", moe_tp="experts"),
    "tp2-hidden": dict(tp=2, moe_tp="hidden"),
    "pp2": dict(pp=2),
}


@pytest.mark.parametrize("family,layouts,train_in", [
    ("qwen2", LAYOUTS, "tp2-sp"), ("mixtral", MIXTRAL_LAYOUTS, "dp2-ep2")])
def test_imported_model_matches_transformers_and_trains(tmp_path, family, layouts, train_in):
    folder = hf_models.save_random_llama(tmp_path / family, family=family)
    tokens, later = token_batch(99, BATCH, SEQ, VOCAB), token_batch(5, BATCH, SEQ, VOCAB)
    out = tmp_path / "trained"
    ranks = run_distributed(_each_layout_then_train, 2,
                            args=(str(folder), tokens, later, str(out), layouts, train_in),
                            timeout=240)
    want_logits = hf_models.hf_logits(folder, tokens[:, :-1])
    want = {"loss": _hf_loss(want_logits, tokens)}
    if family == "mixtral":  # each expert-parallel rank reads its own 2 of the 4 experts
        assert [got["dp2-ep2"]["expert reads"] for got in ranks] == [{(0, 2)}, {(2, 4)}]
    for name in layouts:
        for rank, got in enumerate(ranks):
            actual, expected = {"loss": got[name]["loss"]}, dict(want)
            if got[name]["logits"] is not None:
                actual["logits"], expected["logits"] = got[name]["logits"], want_logits
            assert_parity(actual, expected, FLOAT64_TOL, f"{name} rank {rank}")
    assert json.loads((Path(out) / "config.json").read_text())["model_type"] == family
    before = _hf_loss(hf_models.hf_logits(folder, later[:, :-1]), later)
    after = _hf_loss(hf_models.hf_logits(out, later[:, :-1]), later)
    assert_parity({"loss": after}, {"loss": ranks[0]["trained loss"]}, FLOAT64_TOL, "continued")
    assert after < before - 1e-3, "five steps of training did not change the loss"
    # `partita export` of the checkpoint the training layout wrote: the same folder.
    _same_folder(export_run(f"{out}-checkpoints", tmp_path / "from-checkpoint"), out)
