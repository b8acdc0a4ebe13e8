"""Mistral and Qwen2 folders, in one process: each imports as the network transformers
computes (Qwen2's q/k/v biases included, permuted with their rows for partita's rotary
pairs), exports as a folder transformers loads without missing or unexpected keys, and
whatever partita would compute differently (a sliding window shorter than the model's
positions, an architecture that disagrees with its model_type) is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from partita.checkpoint.manifest import CheckpointMismatch, check_model, model_fields
from partita.errors import PartitaError
from partita.export import export_hf
from partita.layout import Layout
from partita.models.hf_config import model_config_from_hf
from partita.models.hf_weights import hf_name, partita_names
from partita.models.model_config import ModelConfig
from partita.models.transformer import build_model
from partita.planner import Assumptions, PlanModel
from partita.planner.stage_params import stage_param_counts
from partita.testing import FLOAT64_TOL, assert_parity
from partita.weights import full_state_dict
from tests.unit.test_hf_files import TOKENS, one_process

hf_models = pytest.importorskip("tests.hf_models")
transformers = hf_models.transformers

# What an export of each family is: Mistral's network is Llama's, so it exports as one.
EXPORTED_AS = {"qwen2": ("Qwen2ForCausalLM", "qwen2"), "mistral": ("LlamaForCausalLM", "llama")}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_import_gives_transformers_logits_and_export_loads_cleanly(tmp_path, family, tied):
    folder = hf_models.save_random_llama(tmp_path / family, family=family, tied=tied)
    pm = one_process(folder)
    assert pm.model_cfg.qkv_bias == (family == "qwen2")
    want = hf_models.hf_logits(folder, TOKENS)
    assert_parity({"logits": pm.module(TOKENS)}, {"logits": want}, FLOAT64_TOL, family)
    out = export_hf(full_state_dict(pm), pm.model_cfg, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"][0], config["model_type"]) == EXPORTED_AS[family]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float64, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert_parity({"logits": hf_models.hf_logits(out, TOKENS)}, {"logits": want},
                  FLOAT64_TOL, f"{family} exported")


def test_qwen2_biases_are_imported_and_named_one_to_one(tmp_path):
    """The biases carry real values: zeroing them in the files changes the logits."""
    cfg = ModelConfig(n_layers=2, qkv_bias=True)
    names = [hf_name(n) for n in partita_names(cfg)]
    assert len(set(names)) == len(names)
    assert {"model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias",
            "model.layers.1.self_attn.v_proj.bias"} <= set(names)
    assert not any(n.endswith(("o_proj.bias", "mlp.up_proj.bias")) for n in names)
    folder = hf_models.save_random_llama(tmp_path / "qwen2", family="qwen2")
    with_biases = one_process(folder).module(TOKENS)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
    model.save_pretrained(tmp_path / "zeroed")
    without = one_process(tmp_path / "zeroed").module(TOKENS)
    assert (with_biases - without).abs().max() > 1e-3


# Bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("family,window_keys", [
    ("mistral", dict(sliding_window=16)),
    ("qwen2", dict(sliding_window=16, layer_types=["full_attention", "sliding_attention"])),
    # Written before layer_types: layers from max_window_layers on are windowed.
    ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=1,
                   layer_types=None)),
])
def test_a_sliding_window_shorter_than_the_positions_is_refused(tmp_path, family, window_keys):
    folder = hf_models.save_random_llama(tmp_path / family, family=family)
    hf_models.edit_config(folder, **window_keys)
    with pytest.raises(PartitaError, match=r"sliding-window attention \(16: each token sees "
                       r"only the 16 before it.*all 64 positions.*\"sliding_window\": null"):
        model_config_from_hf(folder)
    # The fix the message names imports the model.
    hf_models.edit_config(folder, sliding_window=None)
    assert model_config_from_hf(folder).max_seq_len == 64


@pytest.mark.parametrize("family,window_keys", [
    ("mistral", dict(sliding_window=64)),  # as long as the positions: never cuts
    ("qwen2", dict(sliding_window=16, use_sliding_window=False, layer_types=None)),
    ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=2,
                   layer_types=None)),  # no layer from 2 on in a 2-layer model
    ("qwen2", dict(sliding_window=16, layer_types=["full_attention"] * 2)),
])
def test_a_window_no_layer_is_cut_by_imports(tmp_path, family, window_keys):
    folder = hf_models.save_random_llama(tmp_path / family, family=family)
    hf_models.edit_config(folder, **window_keys)
    model_config_from_hf(folder)


def test_an_architecture_other_than_its_model_type_s_is_refused(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "qwen2", family="qwen2")
    hf_models.edit_config(folder, architectures=["LlamaForCausalLM"])
    with pytest.raises(PartitaError, match=r"names the architecture LlamaForCausalLM with "
                       r"model_type='qwen2', which transformers builds as Qwen2ForCausalLM"):
        model_config_from_hf(folder)


def test_qkv_bias_is_for_llama_flavoured_models():
    with pytest.raises(PartitaError, match="model.qkv_bias=true is for llama-flavoured.*"
                       "Remove model.qkv_bias"):
        ModelConfig(flavour="gpt2", qkv_bias=True)

def test_qkv_biases_are_counted_as_the_model_and_a_tensor_parallel_rank_hold_them():
    biased, plain = ModelConfig(n_kv_heads=2, qkv_bias=True), ModelConfig(n_kv_heads=2)
    kv = plain.kv_heads * plain.head_dim
    assert biased.block_param_count() - plain.block_param_count() == plain.dim + 2 * kv
    model = build_model(biased, device="meta")
    assert sum(p.numel() for p in model.parameters()) == biased.num_params()
    # The planner: each tp rank holds its share of the biases, like the projections' rows;
    # at tp above the kv heads the k and v biases of the heads it keeps: one (Megatron's
    # default assumption) or every one (partita's own, `whole_kv_replicas`).
    whole = Assumptions(whole_kv_replicas=True)
    for tp, assumptions, kv_share in ((2, Assumptions(), kv / 2), (4, Assumptions(), kv / 2),
                                      (4, whole, kv)):
        extra = [stage_param_counts(PlanModel("m", c), Layout(tp=tp), 0, assumptions)["dense"]
                 for c in (biased, plain)]
        assert extra[0] - extra[1] == biased.n_layers * (biased.dim / tp + 2 * kv_share)


def test_a_checkpoint_of_the_model_without_biases_is_refused(tmp_path):
    saved = {"model": model_fields(ModelConfig())}
    with pytest.raises(CheckpointMismatch, match="qkv_bias: checkpoint False, this run True"):
        check_model(saved, ModelConfig(qkv_bias=True), tmp_path)
