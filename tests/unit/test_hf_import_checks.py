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

from partita.config import load_config
from partita.errors import PartitaError
from partita.layout import Degrees
from partita.mesh import Mesh
from partita.models.hf_config import model_config_from_hf
from partita.models.hf_weights import HFWeights

hf_models = pytest.importorskip("tests.hf_models")



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
    hf_models.edit_config(folder, tie_word_embeddings=False)
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


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_rope_type_under_its_older_name_is_read_in_either_key(tmp_path, key):
    """`{"type": "linear", ...}` in rope_parameters read as no scaling: trained without
    a word, logits 7% off transformers'."""
    folder = hf_models.save_random_llama(tmp_path / "l", dim=64, heads=2, kv_heads=1)
    other = "rope_scaling" if key == "rope_parameters" else "rope_parameters"
    hf_models.edit_config(folder, **{key: {"type": "linear", "factor": 4.0, "rope_theta": 5e5},
                            other: None})
    with pytest.raises(PartitaError, match="RoPE scaling 'linear'"):
        model_config_from_hf(folder)
    llama3 = {("type" if k == "rope_type" else k): v for k, v in hf_models.LLAMA3_SCALING.items()}
    hf_models.edit_config(folder, **{key: {**llama3, "rope_theta": 5e5}})
    cfg = model_config_from_hf(folder)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_theta) == ("llama3", 8.0, 5e5)
    read = hf_models.transformers.AutoConfig.from_pretrained(folder).rope_parameters
    assert (read["rope_type"], read["factor"], read["rope_theta"]) == ("llama3", 8.0, 5e5)


def test_rope_given_twice_must_say_the_same(tmp_path):
    """transformers reads rope_scaling where both keys are given, other tools
    rope_parameters: two keys that disagree have no one meaning."""
    folder = hf_models.save_random_llama(tmp_path / "l", dim=64, heads=2, kv_heads=1)
    hf_models.edit_config(folder, rope_parameters={**hf_models.LLAMA3_SCALING, "rope_theta": 5e5},
                 rope_scaling={"rope_type": "default"}, rope_theta=5e5)
    with pytest.raises(PartitaError, match=r"both as rope_parameters and rope_scaling, "
                       r"and they disagree: factor=8.0 in rope_parameters but None in "
                       r"rope_scaling.*rope_type='llama3' in rope_parameters but "
                       r"'default' in rope_scaling"):
        model_config_from_hf(folder)
    # A theta only in rope_parameters is not what transformers reads with rope_scaling.
    scaling = {k: v for k, v in hf_models.LLAMA3_SCALING.items()}
    hf_models.edit_config(folder, rope_scaling=scaling, rope_theta=None)
    with pytest.raises(PartitaError, match="rope_theta=500000.0 in rope_parameters but "
                                           "10000.0 in rope_scaling"):
        model_config_from_hf(folder)
    # As partita exports it: both keys, theta beside them, the same scaling.
    hf_models.edit_config(folder, rope_theta=5e5, rope_scaling={"type": "llama3", **{
        k: v for k, v in hf_models.LLAMA3_SCALING.items() if k != "rope_type"}})
    cfg = model_config_from_hf(folder)
    assert (cfg.rope_scaling, cfg.rope_theta, cfg.rope_original_max_len) == (
        "llama3", 5e5, 32)


def _fake_world(monkeypatch, size: int) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)


def test_a_mesh_world_size_other_than_torch_distributed_s_is_named(monkeypatch):
    """Mesh(Degrees(dp=2)) in a 2-process world said '1 were started' and advised
    --parallel.dp=1; with world_size=4 it said '4 were started'."""
    _fake_world(monkeypatch, 2)
    with pytest.raises(PartitaError) as got:
        Mesh(Degrees(dp=2))
    message = str(got.value)
    assert "Mesh(world_size=1) (its default) disagrees with torch.distributed, whose " \
           "world has 2 processes" in message
    assert "world_size=dist.get_world_size()" in message
    assert "--parallel" not in message and "were started" not in message
    with pytest.raises(PartitaError, match=r"Mesh\(world_size=4\) disagrees with "
                                           r"torch.distributed, whose world has 2"):
        Mesh(Degrees(dp=2), 0, 4)
    # A one-process mesh may still be built inside the larger world.
    assert Mesh(Degrees()).rank == 0


def test_a_moved_model_folder_is_named_as_missing_not_as_lacking_its_config(tmp_path):
    """`partita export` and `generate` of a run whose model.init_from folder was moved
    advised giving a folder a model was saved to, which neither command can take."""
    gone = tmp_path / "moved-away"
    with pytest.raises(PartitaError, match=r"model.init_from='.*moved-away' does not exist"
                       r".*restore the folder or set model.init_from in the run's "
                       r"config.toml"):
        load_config(None, [f"--model.init_from={gone}"]).model_config()
    gone.mkdir()  # a folder that exists keeps the message about its config.json
    with pytest.raises(PartitaError, match="has no config.json; give the folder"):
        load_config(None, [f"--model.init_from={gone}"]).model_config()
