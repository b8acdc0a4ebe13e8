"""Rank <-> coordinate math and group construction, without processes."""

import itertools

import pytest

from partita.config import Config
from partita.errors import PartitaError
from partita.layout import Degrees, Layout
from partita.mesh import (
    all_groups,
    check_world_size,
    coord,
    expert_group_ranks,
    group_ranks,
    rank_at,
)


def _combos(max_world: int):
    powers = [1, 2, 4, 8, 16, 32, 64]
    for tp, cp, dp, pp in itertools.product(powers, repeat=4):
        if tp * cp * dp * pp <= max_world:
            yield tp, cp, dp, pp


def test_every_combination_up_to_1024_ranks_is_a_bijection():
    checked = 0
    for tp, cp, dp, pp in _combos(1024):
        dims = Degrees(dp=dp, tp=tp, pp=pp, cp=cp)
        coords = [coord(dims, r) for r in range(dims.world_size)]
        assert len(set(coords)) == dims.world_size
        for r, c in enumerate(coords):
            assert rank_at(dims, c.tp, c.cp, c.dp, c.pp) == r
        checked += 1
    assert checked > 300


@pytest.mark.parametrize("tp,cp,dp,pp", [(2, 1, 2, 2), (4, 2, 2, 1), (1, 1, 8, 1), (2, 2, 2, 2)])
def test_groups_partition_the_world_and_vary_one_axis(tp, cp, dp, pp):
    dims = Degrees(dp=dp, tp=tp, pp=pp, cp=cp)
    for purpose, groups in all_groups(dims).items():
        members = sorted(r for g in groups for r in g)
        assert members == list(range(dims.world_size)), purpose
    for axis in ("tp", "cp", "dp", "pp"):
        for group in group_ranks(dims, (axis,)):
            coords = [coord(dims, r) for r in group]
            for other in {"tp", "cp", "dp", "pp"} - {axis}:
                assert len({getattr(c, other) for c in coords}) == 1
            assert sorted(getattr(c, axis) for c in coords) == list(range(dims.sizes()[axis]))


def test_tp_is_fastest_and_pp_slowest():
    dims = Layout(dp=2, tp=2, pp=2).degrees
    assert group_ranks(dims, ("tp",))[0] == [0, 1]
    assert group_ranks(dims, ("dp",))[0] == [0, 2]
    assert group_ranks(dims, ("pp",))[0] == [0, 4]


def test_expert_groups_are_carved_from_data_and_context():
    dims = Degrees(dp=4, cp=2, tp=2, ep=4)
    ep, edp = expert_group_ranks(dims)
    dpcp = group_ranks(dims, ("cp", "dp"))
    for group in ep + edp:
        assert any(set(group) <= set(g) for g in dpcp)
    assert all(len(g) == 4 for g in ep) and all(len(g) == 2 for g in edp)
    assert sorted(r for g in ep for r in g) == list(range(dims.world_size))


def test_bad_degrees_explain_themselves():
    with pytest.raises(PartitaError, match="positive integer"):
        Degrees(dp=0)
    with pytest.raises(PartitaError, match="zero_stage"):
        Layout(zero_stage=4)
    with pytest.raises(PartitaError, match="must divide dp"):
        Layout(dp=2, ep=3)
    # Built in Python, the mesh's own arguments are named, not the command line's options.
    with pytest.raises(PartitaError) as got:
        check_world_size(Degrees(dp=2, tp=2, pp=2), 4)
    assert str(got.value) == (
        "Degrees(dp=2, tp=2, pp=2, cp=1) needs 8 processes, but the Mesh is built with "
        "world_size=4. Start 8 processes (torchrun --nproc-per-node 8), or choose degrees "
        "whose product is 4 (dp=1).")
    assert "--parallel" not in str(got.value)
    cfg = Config()
    cfg.parallel.tp = 4
    with pytest.raises(PartitaError, match="does not divide"):
        cfg.layout(6)
    cfg.parallel.tp = 2
    assert cfg.layout(8).dp == 4
