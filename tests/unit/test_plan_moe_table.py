"""A model file's [moe] table overrides the experts of the model it names, as [model]
fields do, and a [moe] table that cannot apply is refused with what to change."""

import pytest

from partita.errors import PartitaError
from partita.planner.model_shape import resolve_model


def _model(tmp_path, text: str):
    path = tmp_path / "model.toml"
    path.write_text(text)
    return resolve_model(str(path))


def test_moe_table_overrides_a_catalog_moe_model(tmp_path):
    top1 = _model(tmp_path, '[model]\nname = "mixtral-8x7b"\n[moe]\ntop_k = 1\n')
    assert (top1.moe.num_experts, top1.moe.top_k) == (8, 1)
    assert top1.config.top_k == 1
    # Top-1 routes half the expert FLOPs of top-2: 2 x 3 x 4096 x 14336 per token and
    # block fewer, x 32 blocks, x 3 (forward and backward).
    top2 = resolve_model("mixtral-8x7b")
    assert top2.flops_per_token(4096) - top1.flops_per_token(4096) == \
        6 * 32 * 3 * 4096 * 14336
    narrow = _model(tmp_path, '[model]\nname = "mixtral-8x7b"\n[moe]\nexpert_ffn_dim = 1024\n')
    assert narrow.expert_ffn == 1024 and narrow.config.expert_ffn_dim == 1024
    assert narrow.total_params() == pytest.approx(4.83e9, rel=0.01)


def test_experts_in_model_and_top_k_in_moe_table(tmp_path):
    m = _model(tmp_path, "[model]\nn_layers = 32\ndim = 4096\nn_heads = 32\nvocab_size = "
                         "32000\nmax_seq_len = 4096\nn_experts = 8\n[moe]\ntop_k = 2\n")
    assert (m.moe.num_experts, m.moe.top_k) == (8, 2) and m.is_moe


def test_moe_table_that_cannot_apply_is_refused(tmp_path):
    # Experts on a dense catalog model need their top_k (the model's own is no MoE's).
    with pytest.raises(PartitaError, match=r"\[moe\] num_experts = 8 without top_k"):
        _model(tmp_path, '[model]\nname = "llama3-8b"\n[moe]\nnum_experts = 8\n')
    with pytest.raises(PartitaError, match=r"\[moe\] top_k: this model has no experts"):
        _model(tmp_path, '[model]\nname = "llama3-8b"\n[moe]\ntop_k = 1\n')
    # One expert is a dense model, as the [moe] table has always read it.
    dense = _model(tmp_path, '[model]\nname = "llama3-8b"\n[moe]\nnum_experts = 1\n')
    assert not dense.is_moe and dense.config.n_experts == 0
