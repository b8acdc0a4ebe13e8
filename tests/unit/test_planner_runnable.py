"""Every layout the planner ranks for small CPU worlds is one `partita train` accepts."""

import pytest

from partita.config import Config, layout_overrides, load_config
from partita.layout_rules import UNAVAILABLE, find_problems
from partita.planner import make_request, search
from partita.planner.search import SearchSpace

DEFAULTS = Config()  # the command line's defaults: the tiny model, seq 128, batch 16
SEQ, BATCH = DEFAULTS.data.seq_len, DEFAULTS.train.global_batch


def _ranked(world: int, space: SearchSpace | None = None):
    req = make_request(DEFAULTS.model.name, world, seq_len=SEQ, global_batch=BATCH)
    return search(req, space or SearchSpace())


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_ranked_layout_passes_validate_and_the_config(world):
    result = _ranked(world)
    assert result.ranked
    for ev in result.ranked:
        lay = ev.layout
        cfg = load_config(overrides=layout_overrides(lay, BATCH))
        model = cfg.model_config()
        assert model == DEFAULTS.model_config()
        assert find_problems(lay, model, world, seq_len=SEQ, global_batch=BATCH) == [], lay
        # The settings `partita plan` prints give back the same layout.
        assert cfg.layout(world) == lay


@pytest.mark.parametrize("world", [2, 8])
def test_options_not_built_yet_are_never_ranked(world):
    result = _ranked(world, SearchSpace.everything())
    model = DEFAULTS.model_config()
    for ev in result.ranked:
        lay = ev.layout
        assert lay.cp == lay.ep == 1
        # Offload is ranked from the wider space, and `partita train` takes it as printed.
        assert find_problems(lay, model, world, seq_len=SEQ, global_batch=BATCH) == [], lay
        assert load_config(overrides=layout_overrides(lay, BATCH)).layout(world) == lay
    assert any(ev.layout.offload != "none" for ev in result.ranked)
    default = _ranked(world)
    assert UNAVAILABLE not in default.rejected
    # Offload runs, but only the wider space searches it.
    assert {e.layout for e in default.ranked} == {e.layout for e in result.ranked
                                                  if e.layout.offload == "none"}


def test_the_search_covers_every_dimension_combination_and_zero_stage():
    shapes, zeros = set(), set()
    for world in (1, 2, 4, 8):
        for ev in _ranked(world).ranked:
            lay = ev.layout
            shapes.add(tuple(d for d in ("dp", "tp", "pp") if getattr(lay, d) > 1))
            zeros.add(lay.zero_stage)
    assert shapes == {(), ("dp",), ("tp",), ("pp",), ("dp", "tp"), ("dp", "pp"),
                      ("tp", "pp"), ("dp", "tp", "pp")}
    assert zeros == {0, 1, 2, 3}


@pytest.mark.parametrize("world", [2, 4])
def test_a_mixture_of_experts_search_ranks_expert_and_tensor_parallel_layouts(world):
    """Expert parallelism runs, so a default search of an MoE model ranks it; tp > 1
    comes with sequence parallelism, as for dense models. Every ranked layout is one
    `partita train` accepts as printed."""
    model_args = ["--model.name=tiny-moe"]
    req = make_request("tiny-moe", world, seq_len=SEQ, global_batch=BATCH)
    result = search(req)
    model = load_config(overrides=model_args).model_config()
    assert UNAVAILABLE not in result.rejected
    for ev in result.ranked:
        lay = ev.layout
        assert lay.sequence_parallel == (lay.tp > 1), lay
        assert find_problems(lay, model, world, seq_len=SEQ, global_batch=BATCH) == [], lay
        cfg = load_config(overrides=model_args + layout_overrides(lay, BATCH))
        assert cfg.layout(world) == lay
    ranked = {ev.layout for ev in result.ranked}
    assert {lay.ep for lay in ranked} == {d for d in (1, 2, 4) if d <= world}
    assert any(lay.tp > 1 for lay in ranked)
