"""Hugging Face folders that partita once imported as another model than transformers
does, or refused with advice the reader could not act on: a tied config over files that
also hold a different head, RoPE scaling under the older `type` name or given twice,
a Mesh whose world size disagrees with torch.distributed's, and a run whose model folder
was moved."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from partita.errors import PartitaError
from partita.models.hf_config import model_config_from_hf
from partita.models.hf_weights import HFWeights

hf_models = pytest.importorskip("tests.hf_models")

def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _add_head(folder, head: torch.Tensor) -> None:
    """Write `lm_head.weight` into the folder's last shard and its index."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    tensors = load_file(folder / shard)
    tensors["lm_head.weight"] = head.contiguous()
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = shard
    index_path.write_text(json.dumps(index))


def _embeddings(folder) -> torch.Tensor:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.embed_tokens.weight"]
    return load_file(folder / shard)["model.embed_tokens.weight"]


def test_a_tied_config_over_a_different_head_in_the_files_is_refused(tmp_path):
    """transformers computes such a folder with the file's head (it only warns); partita
    tied the head to the embeddings without a word and its export dropped the file's."""
    folder = hf_models.save_random_llama(tmp_path / "tied", tied=True)
    _add_head(folder, torch.randn_like(_embeddings(folder)))
    with pytest.raises(PartitaError, match=r"holds 'lm_head.weight', which differs from "
                       r"'model.embed_tokens.weight'.*tie_word_embeddings.*"
                       r"\"tie_word_embeddings\": false in config.json.*remove "
                       r"'lm_head.weight'"):
        HFWeights(folder, model_config_from_hf(folder))
    # The first fix the message names imports the file's head.
    _edit_config(folder, tie_word_embeddings=False)
    cfg = model_config_from_hf(folder)
    assert not cfg.tie_embeddings
    HFWeights(folder, cfg).close()


def test_a_head_that_only_differs_in_its_last_row_is_refused(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "tied", tied=True)
    head = _embeddings(folder).clone()
    head[-1, -1] += 1.0
    _add_head(folder, head)
    with pytest.raises(PartitaError, match="differs from 'model.embed_tokens.weight'"):
        HFWeights(folder, model_config_from_hf(folder))


def test_a_head_equal_to_the_embeddings_is_the_tied_model(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "tied", tied=True)
    _add_head(folder, _embeddings(folder).to(torch.float32))  # equal values, other dtype
    cfg = model_config_from_hf(folder)
    assert cfg.tie_embeddings
    HFWeights(folder, cfg).close()


def test_folders_without_an_extra_head_read_no_tensor_at_opening(tmp_path, monkeypatch):
    """Each rank reads only its slices: opening a tied or untied folder reads headers."""
    def refuse(self):
        raise AssertionError("read whole tensors at opening")

    monkeypatch.setattr(HFWeights, "_check_tied_head", refuse)
    for tied in (True, False):
        folder = hf_models.save_random_llama(tmp_path / f"t{tied}", tied=tied)
        HFWeights(folder, model_config_from_hf(folder)).close()
