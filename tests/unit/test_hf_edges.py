"""Hugging Face folders as they come from real releases: quantised weights, configs that
leave RoPE keys to their defaults, indexes that do not match their files, tokenizers with
gaps in their ids or special ids only in config.json, and what an export must carry for
other tools (RoPE scaling under its older key, the end ids, the chat template, the
generation defaults)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from partita.errors import PartitaError
from partita.export import export_hf
from partita.models.hf_config import hf_config_from_model, model_config_from_hf
from partita.models.hf_weights import HFWeights, expected_shapes

hf_models = pytest.importorskip("tests.hf_models")



def test_a_quantised_release_is_refused_not_imported_without_its_scales(tmp_path):
    """An FP8 release's float8 weights were cast as they were (448 where the model holds
    0.07) and trained without a word."""
    folder = hf_models.save_random_llama(tmp_path / "fp8")
    hf_models.edit_config(folder, quantization_config={"quant_method": "fbgemm_fp8"})
    with pytest.raises(PartitaError, match="quantization_config.*fbgemm_fp8.*unquantised"):
        model_config_from_hf(folder)
    # The tensors alone give it away too (a config that lost its quantization entry).
    folder = hf_models.save_random_llama(tmp_path / "f8")
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    name = next(iter(tensors))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(PartitaError, match=f"holds '{name}' as F8_E4M3, not floating point"):
        HFWeights(folder, model_config_from_hf(folder))


def test_llama3_scaling_without_its_original_length_reads_as_transformers_does(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "l3", dim=64, heads=2, kv_heads=1,
                                         rope_theta=500000.0, rope_scaling=hf_models.LLAMA3_SCALING)
    scaling = {k: v for k, v in hf_models.LLAMA3_SCALING.items() if k != "original_max_position_embeddings"}
    hf_models.edit_config(folder, rope_scaling=scaling, rope_parameters=None, rope_theta=500000.0)
    cfg = model_config_from_hf(folder)
    assert cfg.rope_original_max_len == cfg.max_seq_len  # transformers' default
    hf_models.edit_config(folder, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(PartitaError, match="llama3 RoPE scaling without low_freq_factor, "
                                           "high_freq_factor"):
        model_config_from_hf(folder)


@pytest.mark.parametrize("damage", ["wrong shard", "list"])
def test_an_index_that_does_not_match_its_files_is_named(tmp_path, damage):
    folder = hf_models.save_random_llama(tmp_path / "llama")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    if damage == "list":
        index["weight_map"] = list(index["weight_map"])
        match = "weight_map that is not an object"
    else:
        files = sorted(set(index["weight_map"].values()))
        key = next(k for k, v in index["weight_map"].items() if v == files[-1])
        index["weight_map"][key] = files[0]
        match = f"does not hold '{key}', which the folder's index places there"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PartitaError, match=match):
        HFWeights(folder, model_config_from_hf(folder))


def test_an_export_carries_what_older_tools_and_chat_models_read(tmp_path):
    """The llama3 scaling was written only as rope_parameters (tools that predate it read
    plain RoPE); a source's list of end ids and pad id were dropped."""
    cfg = model_config_from_hf(hf_models.save_random_llama(
        tmp_path / "l3", dim=64, heads=2, kv_heads=1, rope_theta=500000.0,
        rope_scaling=hf_models.LLAMA3_SCALING))
    config = hf_config_from_model(cfg, eos_token_id=[1, 2], pad_token_id=2)
    assert config["rope_scaling"] == {k: v for k, v in config["rope_parameters"].items()
                                      if k != "rope_theta"}
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert (config["eos_token_id"], config["pad_token_id"]) == ([1, 2], 2)
    assert "rope_scaling" not in hf_config_from_model(
        model_config_from_hf(hf_models.save_random_llama(tmp_path / "plain")))
    # transformers reads the export with both keys as the scaled model.
    zeros = {n: torch.zeros(s) for n, s in expected_shapes(cfg).items()}
    out = export_hf(zeros, cfg, tmp_path / "o")
    loaded = hf_models.transformers.AutoConfig.from_pretrained(out)
    assert loaded.rope_parameters["rope_type"] == "llama3"


def test_export_run_copies_the_generation_defaults_and_chat_template(tmp_path, monkeypatch):
    from partita import export

    source = hf_models.save_random_llama(tmp_path / "src")
    hf_models.edit_config(source, eos_token_id=[1, 2], pad_token_id=2)
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "chat_template.jinja").write_text("{{ messages }}")
    cfg = model_config_from_hf(source)
    written = {}

    def fake_export_hf(state, model_cfg, out, tokenizer=None, **kw):
        written.update(kw, tokenizer=tokenizer)
        return out

    class Run:
        class model:
            init_from = str(source)

        class data:
            tokenizer = str(tok)

        def model_config(self):
            return cfg

    monkeypatch.setattr(export, "run_source", lambda _d: (Run(), dict))
    monkeypatch.setattr(export, "export_hf", fake_export_hf)
    monkeypatch.setattr("partita.data.hf_tokenizer.special_token_ids",
                        lambda _t, bos, eos: (bos, 2 if eos is None else eos))
    export.export_run(tmp_path / "run", tmp_path / "out")
    assert written["eos_token_id"] == [1, 2] and written["pad_token_id"] == 2
    assert [p.name for p in written["also_copy"]] == ["generation_config.json"]
    assert "chat_template.jinja" in [p.name for p in export.tokenizer_files(tok)]


def test_a_tokenizer_with_gaps_in_its_ids_sizes_the_vocabulary_by_its_largest(tmp_path):
    """5 tokens with ids up to 500 counted as a vocabulary of 5: the check against the
    model passed and tokenizing failed with a traceback."""
    tokenizers = pytest.importorskip("tokenizers")
    from partita.data.hf_tokenizer import HFTokenizer

    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3, "z": 500}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.save(str(tmp_path / "tokenizer.json"))
    assert HFTokenizer(tmp_path).vocab_size == 501


def test_bos_and_eos_fall_back_to_config_json_one_by_one(tmp_path):
    """config.json's ids were read only when tokenizer_config.json named neither token:
    a tokenizer_config with a BOS and no EOS left documents without an end."""
    tokenizers = pytest.importorskip("tokenizers")
    from partita.data.hf_tokenizer import HFTokenizer

    vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "a": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                                "eos_token": None}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    loaded = HFTokenizer(tmp_path)
    assert (loaded.bos_id, loaded.eos_id) == (0, 2)
