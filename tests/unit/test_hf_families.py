"""Mistral, Qwen2 and Mixtral folders, in one process: each imports as the network
transformers computes (Qwen2's q/k/v biases included, permuted with their rows for
partita's rotary pairs; Mixtral's experts, one file tensor each, stacked; a sliding
window on every layer kept, training sequences held within it), exports as a folder
transformers loads without missing or unexpected keys, and whatever partita would
compute differently (a window on some layers only, an architecture that disagrees with
its model_type, a lone expert per token, router noise) is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from partita.checkpoint.manifest import CheckpointMismatch, check_model, model_fields
from partita.config import load_config
from partita.errors import PartitaError
from partita.export import export_hf
from partita.layout import Layout
from partita.models.hf_config import hf_config_from_model, model_config_from_hf
from partita.models.hf_weights import HFWeights, hf_name, partita_names
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
EXPORTED_AS = {"qwen2": ("Qwen2ForCausalLM", "qwen2"), "mistral": ("LlamaForCausalLM", "llama"),
               "mixtral": ("MixtralForCausalLM", "mixtral")}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", ["qwen2", "mistral", "mixtral"])
def test_import_gives_transformers_logits_and_export_loads_cleanly(tmp_path, family, tied):
    folder = hf_models.save_random_llama(tmp_path / family, family=family, tied=tied)
    pm = one_process(folder)
    assert pm.model_cfg.qkv_bias == (family == "qwen2")
    assert pm.model_cfg.n_experts == (4 if family == "mixtral" else 0)
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

@pytest.mark.parametrize("window_keys", [
    dict(sliding_window=16, layer_types=["full_attention", "sliding_attention"]),
    # Written before layer_types: layers from max_window_layers on are windowed.
    dict(sliding_window=16, use_sliding_window=True, max_window_layers=1, layer_types=None),
])
def test_a_window_on_some_layers_is_refused(tmp_path, window_keys):
    folder = hf_models.save_random_llama(tmp_path / "qwen2", family="qwen2")
    hf_models.edit_config(folder, **window_keys)
    with pytest.raises(PartitaError, match=r"sliding-window attention on some layers \(16: "
                       r"each token of those sees only the 16 before it.*all 64 positions.*"
                       r"\"use_sliding_window\": false"):
        model_config_from_hf(folder)
    # The fix the message names imports the model, without a window.
    hf_models.edit_config(folder, use_sliding_window=False, layer_types=None)
    assert model_config_from_hf(folder).attention_window is None


@pytest.mark.parametrize("family,exported_as", [
    ("mistral", "MistralForCausalLM"), ("mixtral", "MixtralForCausalLM")])
def test_a_window_on_every_layer_trains_up_to_it_and_is_exported(tmp_path, family,
                                                                  exported_as):
    """Full causal attention is the windowed one on sequences no longer than the window:
    partita keeps the window, computes transformers' logits there (16 tokens, a window of
    16), refuses longer training sequences, and writes the window back."""
    folder = hf_models.save_random_llama(tmp_path / family, family=family, sliding_window=16)
    pm = one_process(folder)
    assert pm.model_cfg.attention_window == 16
    inputs = TOKENS[:, :16]  # the training inputs (TOKENS holds their targets' one more)
    want = hf_models.hf_logits(folder, inputs)
    assert_parity({"logits": pm.module(inputs)}, {"logits": want}, FLOAT64_TOL, family)
    out = export_hf(full_state_dict(pm), pm.model_cfg, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["sliding_window"]) == ([exported_as], 16)
    assert_parity({"logits": hf_models.hf_logits(out, inputs)}, {"logits": want},
                  FLOAT64_TOL, f"{family} exported")
    # One token more and the window cuts: transformers' logits are not partita's.
    longer = TOKENS[:, :17]
    assert (hf_models.hf_logits(folder, longer) - pm.module(longer)).abs().max() > 1e-3
    with pytest.raises(PartitaError, match=r"data.seq_len=32 exceeds the model's attention "
                       r"window of 16 positions from .*sliding_window in its config.json.*"
                       r"Train at data.seq_len <= 16"):
        load_config(None, [f"--model.init_from={folder}", "--data.seq_len=32"]).model_config()


def test_qwen2_with_a_window_on_every_layer_exports_it_on_every_layer(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "qwen2", family="qwen2", sliding_window=16,
                                         layer_types=["sliding_attention"] * 2,
                                         use_sliding_window=True, max_window_layers=0)
    cfg = model_config_from_hf(folder)
    assert (cfg.attention_window, cfg.qkv_bias) == (16, True)
    exported = hf_config_from_model(cfg)
    assert (exported["sliding_window"], exported["use_sliding_window"],
            exported["layer_types"]) == (16, True, ["sliding_attention"] * 2)


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
    # Imported without a window: since windows on every layer are kept rather than
    # refused, not raising alone would no longer show that none was found.
    assert model_config_from_hf(folder).attention_window is None


def test_mixtral_settings_reach_the_model_and_its_export(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "mixtral", family="mixtral",
                                         num_local_experts=8, num_experts_per_tok=2,
                                         router_aux_loss_coef=0.02)
    cfg = model_config_from_hf(folder)
    assert (cfg.n_experts, cfg.top_k, cfg.moe_every, cfg.expert_hidden) == (8, 2, 1, 64)
    assert (cfg.capacity_factor, cfg.shared_experts, cfg.router_gating) == (None, 0, "softmax")
    assert (cfg.aux_loss_weight, cfg.z_loss_weight, cfg.router_norm_topk) == (0.02, 0.0, True)
    exported = hf_config_from_model(cfg)
    assert {k: exported[k] for k in ("num_local_experts", "num_experts_per_tok",
                                     "intermediate_size", "router_aux_loss_coef")} == \
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64,
         "router_aux_loss_coef": 0.02}


@pytest.mark.parametrize("changes,says", [
    (dict(num_experts_per_tok=1), r"num_experts_per_tok=1 \(Mixtral rescales a lone "
                                  r"expert's gate weight to one"),
    (dict(router_jitter_noise=0.1), r"router_jitter_noise=0.1 \(partita's router adds no "
                                    r"noise"),
    (dict(num_experts_per_tok=9), r"num_local_experts=4 and num_experts_per_tok=9"),
])
def test_a_mixtral_partita_routes_otherwise_is_refused(tmp_path, changes, says):
    folder = hf_models.save_random_llama(tmp_path / "mixtral", family="mixtral")
    hf_models.edit_config(folder, **changes)
    with pytest.raises(PartitaError, match=says + ".*cannot be imported"):
        model_config_from_hf(folder)


@pytest.mark.parametrize("changes,says", [
    (dict(moe_every=2), r"model.moe_every=2 \(Mixtral: 1\)"),
    (dict(shared_experts=1), r"model.shared_experts=1 \(Mixtral: 0\)"),
    (dict(router_gating="sigmoid"), r"model.router_gating='sigmoid' \(Mixtral: 'softmax'\)"),
    (dict(capacity_factor=1.0), r"model.capacity_factor=1.0 \(Mixtral: None\)"),
    (dict(top_k=1), r"model.top_k=1 \(Mixtral rescales"),
])
def test_experts_without_a_mixtral_form_are_refused_on_export(changes, says):
    cfg = ModelConfig(**{"n_experts": 4, "top_k": 2, **changes})
    with pytest.raises(PartitaError, match=says + ".*no Hugging Face Mixtral equivalent"):
        hf_config_from_model(cfg)


def _drop_tensor(folder, key: str) -> None:
    """Remove tensor `key` from the folder's shard holding it, and from the index."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / index["weight_map"].pop(key)
    tensors = load_file(shard)
    del tensors[key]
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("family,key,partita_name", [
    ("qwen2", "model.layers.1.self_attn.k_proj.bias", "blocks.1.attn.wk.bias"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w2.weight",
     "blocks.0.mlp.experts.w_down"),
])
def test_a_folder_without_a_tensor_its_config_implies_is_named(tmp_path, family, key,
                                                                partita_name):
    folder = hf_models.save_random_llama(tmp_path / family, family=family)
    _drop_tensor(folder, key)
    with pytest.raises(PartitaError, match=f"has no tensor '{key}' \\(partita's "
                       f"'{partita_name}'\\)"):
        HFWeights(folder, model_config_from_hf(folder))


def test_an_expert_of_another_width_is_named(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "mixtral", family="mixtral")
    hf_models.edit_config(folder, intermediate_size=96)
    with pytest.raises(PartitaError, match=r"experts.0.w1.weight' of shape \(64, 32\) but "
                       r"config.json implies \(96, 32\)"):
        HFWeights(folder, model_config_from_hf(folder))


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


def test_plan_reads_a_hugging_face_folder(tmp_path, capsys):
    from partita.cli import main

    folder = hf_models.save_random_llama(tmp_path / "qwen2", family="qwen2")
    for given in (folder, folder / "config.json"):
        assert main(["plan", "--model", str(given), "--gpus", "8", "--json"]) == 0
        shape = json.loads(capsys.readouterr().out)["model_shape"]
        assert (shape["layers"], shape["hidden"], shape["qkv_bias"]) == (2, 32, True)
    assert main(["plan", "--model", str(tmp_path), "--gpus", "8"]) != 0
    assert "is a folder without config.json; give a Hugging Face model folder" in \
        capsys.readouterr().err


def test_plan_of_a_windowed_model_stays_within_its_window(tmp_path, capsys):
    from partita.cli import main

    folder = hf_models.save_random_llama(tmp_path / "mistral", family="mistral",
                                         sliding_window=16)
    assert main(["plan", "--model", str(folder), "--gpus", "2"]) == 0
    assert "--seq-len 16 (the model's attention window)" in capsys.readouterr().out
    assert main(["plan", "--model", str(folder), "--gpus", "2", "--seq-len", "32"]) != 0
    assert "--seq-len 32 exceeds the model's attention window of 16" in capsys.readouterr().err
