"""Hugging Face Llama folders in and out, in one process: the config mapping, the Llama 3
RoPE scaling, tied embeddings, transformers loading an export without missing or
unexpected keys, and the bad inputs (each a clear error, nothing written damaged)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from partita.config import load_config
from partita.errors import PartitaError
from partita.export import export_hf
from partita.layout import Layout
from partita.mesh import Mesh
from partita.models.hf_config import model_config_from_hf
from partita.models.hf_weights import HFWeights, expected_shapes, hf_name, partita_names
from partita.models.model_config import ModelConfig
from partita.models.rotary import rope_frequencies
from partita.parallelize import build_parallel_model
from partita.testing import FLOAT64_TOL, assert_parity, relative_error, token_batch
from partita.weights import full_state_dict

hf_models = pytest.importorskip("tests.hf_models")
transformers = hf_models.transformers

TOKENS = token_batch(7, 2, 16, 64)
# What the refusal of a model without a Hugging Face form says it would take.
NO_HF_FORM = "only llama-flavoured models, dense or with Mixtral's experts"


def one_process(folder, *extra: str):
    cfg = load_config(None, [f"--model.init_from={folder}", "--train.dtype=float64",
                             "--data.seq_len=16", "--train.global_batch=2", *extra])
    return build_parallel_model(cfg, Mesh(Layout(), 0, 1), torch.device("cpu"))


@pytest.mark.parametrize("tied", [False, True])
def test_import_gives_transformers_logits_and_export_loads_cleanly(tmp_path, tied):
    folder = hf_models.save_random_llama(tmp_path / "llama", tied=tied)
    pm = one_process(folder)
    logits = pm.module(TOKENS)
    want = hf_models.hf_logits(folder, TOKENS)
    assert_parity({"logits": logits}, {"logits": want}, FLOAT64_TOL, f"tied={tied}")
    out = export_hf(full_state_dict(pm), pm.model_cfg, tmp_path / "out")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float64, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert model.config.tie_word_embeddings == tied
    assert_parity({"logits": hf_models.hf_logits(out, TOKENS)}, {"logits": want},
                  FLOAT64_TOL, "exported")


@pytest.mark.parametrize("tied", [False, True])
def test_a_padded_vocabulary_imports_as_zero_rows_and_exports_without_them(tmp_path, tied):
    """vocab 61 padded to 64 rows (model.vocab_multiple=16): the import adds zero rows
    and computes transformers' logits on the real columns; the export is exactly the
    folder it came from (same tensors, vocab_size 61), which transformers loads cleanly."""
    from safetensors.torch import load_file

    vocab = 61
    folder = hf_models.save_random_llama(tmp_path / "llama", tied=tied, vocab=vocab)
    pm = one_process(folder, "--model.vocab_multiple=16")
    assert (pm.model_cfg.vocab_size, pm.model_cfg.padded_vocab_size) == (vocab, 64)
    state = full_state_dict(pm)
    for name in ("tok_embeddings.weight",) + (() if tied else ("output.weight",)):
        assert state[name].shape == (64, 32) and torch.all(state[name][vocab:] == 0), name
    tokens = token_batch(7, 2, 16, vocab)
    want = hf_models.hf_logits(folder, tokens)
    assert_parity({"logits": pm.module(tokens)[..., :vocab]}, {"logits": want}, FLOAT64_TOL,
                  f"padded import, tied={tied}")
    # A tensor-parallel rank's rows across the end of the vocabulary, and a ZeRO-3 flat
    # slice: read from the file where real, zero past it.
    weights = HFWeights(folder, pm.model_cfg)
    name = "tok_embeddings.weight"
    assert torch.equal(weights.slice(name, (64, 32), 0, 32, 64), state[name][32:])
    assert torch.equal(weights.flat_slice(name, 60 * 32 + 5, 63 * 32), state[name].reshape(
        -1)[60 * 32 + 5:63 * 32])
    out = export_hf(state, pm.model_cfg, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == vocab
    exported, original = ({k: v for f in sorted(d.glob("*.safetensors"))
                           for k, v in load_file(f).items()} for d in (out, folder))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float64, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert model.get_input_embeddings().weight.shape == (vocab, 32)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    folder = hf_models.save_random_llama(tmp_path / "llama", dim=64, heads=2, kv_heads=1,
                                         rope_theta=500000.0, rope_scaling=scaling)
    cfg = model_config_from_hf(folder)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_len) == ("llama3", 8.0, 32)
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
    ours = rope_frequencies(cfg)
    # transformers computes them in float32; the scaling moves some by a factor of 8.
    assert relative_error(ours, rotary.inv_freq.double()) < 1e-6
    unscaled = rope_frequencies(model_config_from_hf(
        hf_models.save_random_llama(tmp_path / "plain", dim=64, heads=2, kv_heads=1,
                                    rope_theta=500000.0)))
    assert relative_error(ours, unscaled) > 0.1
    # The whole model against transformers' own (float32 rotary table: its floor).
    logits = one_process(folder).module(TOKENS)
    want = hf_models.hf_logits(folder, TOKENS, float64=False).double()
    assert relative_error(logits, want) < 1e-5
    # And exported back, the scaling survives.
    zeros = {n: torch.zeros(s) for n, s in expected_shapes(cfg).items()}
    out = export_hf(zeros, cfg, tmp_path / "o")
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"


def test_names_map_one_to_one():
    cfg = ModelConfig(n_layers=2)
    names = [hf_name(n) for n in partita_names(cfg)]
    assert len(set(names)) == len(names)
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names


# Bad input ---------------------------------------------------------------------------

def test_unsupported_architecture_is_named_with_the_supported_list(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["GemmaForCausalLM"], model_type="gemma")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PartitaError, match="GemmaForCausalLM.*LlamaForCausalLM.*"
                       "MistralForCausalLM.*Qwen2ForCausalLM"):
        model_config_from_hf(folder)


def test_unsupported_settings_are_named(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_bias": True,
                                                    "hidden_act": "gelu"}))
    with pytest.raises(PartitaError, match="hidden_act='gelu'.*attention_bias"):
        model_config_from_hf(folder)


def test_missing_shard_file_is_named(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "llama")
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(PartitaError, match=victim.name):
        HFWeights(folder, model_config_from_hf(folder))


def test_shape_that_disagrees_with_the_config_is_named(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(PartitaError, match=r"mlp.*\(64, 32\).*\(96, 32\)"):
        HFWeights(folder, model_config_from_hf(folder))


def test_missing_config_and_shape_overrides_are_refused(tmp_path):
    with pytest.raises(PartitaError, match="no config.json"):
        load_config(None, [f"--model.init_from={tmp_path}"]).model_config()
    folder = hf_models.save_random_llama(tmp_path / "llama")
    with pytest.raises(PartitaError, match="model.dim cannot be set with model.init_from"):
        load_config(None, [f"--model.init_from={folder}", "--model.dim=64"]).model_config()


def test_export_refuses_a_non_empty_folder_and_leaves_it_alone(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "llama")
    pm = one_process(folder)
    state = full_state_dict(pm)
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(PartitaError, match="not empty"):
        export_hf(state, pm.model_cfg, target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    bad = {**state, "tok_embeddings.weight": state["tok_embeddings.weight"][:5]}
    with pytest.raises(PartitaError, match="tok_embeddings.weight"):
        export_hf(bad, pm.model_cfg, tmp_path / "new")
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.partial").exists()
    shutil.rmtree(target)


def test_rope_and_norm_settings_reach_the_model():
    cfg = load_config(None, ["--model.rope_theta=500000", "--model.norm_eps=1e-6",
                             "--model.rope_scaling=llama3", "--model.rope_factor=4"]
                      ).model_config()
    assert (cfg.rope_theta, cfg.norm_eps, cfg.rope_scaling, cfg.rope_factor) == (
        500000.0, 1e-6, "llama3", 4.0)
    plain = dataclasses.replace(cfg, rope_scaling="")
    assert not torch.equal(rope_frequencies(cfg), rope_frequencies(plain))
    # High frequencies are kept, the lowest divided by the factor.
    assert rope_frequencies(cfg)[0] == rope_frequencies(plain)[0]
    assert rope_frequencies(cfg)[-1] == pytest.approx(rope_frequencies(plain)[-1] / 4)
    with pytest.raises(PartitaError, match="rope_scaling"):
        load_config(None, ["--model.rope_scaling=yarn"])


@pytest.mark.parametrize(("model", "says"), [
    ("tiny-moe", r"mixture-of-experts model \(model.n_experts=8\) with model.moe_every=2 "
                 r"\(Mixtral: 1\)"), ("tiny-gpt2", "flavour='gpt2'")])
def test_a_model_without_a_llama_form_is_refused_before_training(tmp_path, model, says):
    from partita.commands.train import check_before_torch

    cfg = load_config(None, [f"--model.name={model}", "--train.export=hf",
                             f"--train.out_dir={tmp_path / 'run'}"])
    with pytest.raises(PartitaError, match=f"{says}.*{NO_HF_FORM}"):
        check_before_torch(cfg, 2)
    assert not (tmp_path / "run").exists()
    dense = load_config(None, ["--train.export=hf", f"--train.out_dir={tmp_path / 'ok'}"])
    check_before_torch(dense, 2)  # the default llama model exports


@pytest.mark.parametrize(("model", "says"), [
    ("tiny-moe", r"mixture-of-experts model \(model.n_experts=8\) with model.moe_every=2 "
                 r"\(Mixtral: 1\)"), ("tiny-gpt2", "flavour='gpt2'")])
def test_partita_export_names_a_model_without_a_llama_form_before_reading_weights(
        tmp_path, model, says):
    import argparse

    from partita.commands.export import run as export_command
    from partita.models.catalog import get_model_config
    from partita.models.hf_weights import to_hf_state

    # The library calls, whatever the weights: the model is named, not the weights.
    cfg = get_model_config(model)
    for call in (lambda: to_hf_state({}, cfg), lambda: export_hf({}, cfg, tmp_path / "lib")):
        with pytest.raises(PartitaError, match=f"{says}.*{NO_HF_FORM}") as err:
            call()
        assert "do not match" not in str(err.value)
    assert not (tmp_path / "lib").exists()
    # `partita export` of such a run: refused from its config.toml alone (the weights file
    # here is not even readable), writing nothing.
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(load_config(None, [f"--model.name={model}"]).to_toml())
    (run / "model.safetensors").write_bytes(b"not read")
    args = argparse.Namespace(run=str(run), out=str(tmp_path / "hf"), format="hf",
                              overwrite=False, dtype="")
    with pytest.raises(PartitaError, match=f"{says}.*{NO_HF_FORM}"):
        export_command(args)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


def test_partita_export_of_a_dense_run_folder_reads_its_weights_after_the_check(tmp_path):
    from safetensors.torch import save_file

    from partita.export import export_run

    cfg = load_config(None, ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4"])
    state = {n: torch.full(s, 0.5) for n, s in expected_shapes(cfg.model_config()).items()}
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(cfg.to_toml())
    save_file(state, str(run / "model.safetensors"))
    out = export_run(run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (32, 2)
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].keys() \
        == {hf_name(n) for n in state}
