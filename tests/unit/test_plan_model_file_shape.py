"""A model file without a catalog name gives the whole shape, as --model-shape does:
no vocabulary or sequence length is filled in unseen."""

import pytest

from partita.errors import PartitaError
from partita.planner.model_shape import resolve_model


def test_model_file_without_name_needs_the_whole_shape(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text("[model]\nn_layers = 32\ndim = 4096\nn_heads = 32\n")
    with pytest.raises(PartitaError) as err:
        resolve_model(str(path))
    assert (f"model config '{path}' names no catalog model ([model] name) and no "
            "init_from, so it gives the whole shape: add vocab_size, max_seq_len to its "
            "[model] table") in str(err.value)
    path.write_text("[model]\nn_layers = 32\ndim = 4096\nn_heads = 32\nvocab_size = 32000\n"
                    "max_seq_len = 4096\n")
    c = resolve_model(str(path)).config
    assert (c.vocab_size, c.max_seq_len) == (32000, 4096)
    # A named model fills in the rest from the catalog, as partita train does.
    path.write_text('[model]\nname = "llama3-8b"\nn_layers = 16\n')
    c = resolve_model(str(path)).config
    assert (c.n_layers, c.vocab_size, c.max_seq_len) == (16, 128256, 8192)
