"""The benchmark models: catalog names and the transformers Llama build, with blocks."""

from __future__ import annotations

import pytest

from partita.bench.models import CHOICES, bench_model, block_names, blocks_of
from partita.errors import PartitaError


def test_the_transformers_llama_has_the_shape_of_partitas_20m_preset() -> None:
    ours, vocab = bench_model("llama-20m", "meta")
    hf, hf_vocab = bench_model("hf-llama-20m", "meta")
    count = [sum(p.numel() for p in m.parameters()) for m in (ours, hf)]
    assert count[0] == count[1] and 20e6 < count[0] < 22e6 and vocab == hf_vocab == 8192
    assert block_names(ours) == [f"blocks.{i}" for i in range(4)]
    assert block_names(hf) == [f"layers.{i}" for i in range(4)]
    assert len(blocks_of(hf)) == 4


def test_every_suggested_name_builds_and_an_unknown_one_is_refused() -> None:
    sizes = {name: sum(p.numel() for p in bench_model(name, "meta")[0].parameters())
             for name in CHOICES}
    assert sizes["tiny"] < 1e6 and 90e6 < sizes["llama-100m"] < 110e6
    # A mixture of experts among them (`bench compile --model tiny-moe`), all on each rank.
    moe = bench_model("tiny-moe", "meta")[0]
    assert sum(".experts." in name for name, _ in moe.named_parameters()) == 6
    with pytest.raises(PartitaError, match="unknown model"):
        bench_model("llama-21m")
