"""What a script driving `DataParallel` itself can get wrong, and what the engine does
about it: state dicts read right after a step, torch optimizers stepping sharded
parameters, replicas built from different weights, a Mesh given the wrong rank,
parameters frozen or unfrozen after wrapping, and a module wrapped twice.

Every check runs in one spawned world of 2 ranks (one start-up for all of them); each
returns what it saw, and a PartitaError is caught and returned as its message, so that
one refusal does not end the others.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from partita.errors import PartitaError
from partita.layout import Layout
from partita.mesh import Mesh
from partita.testing import run_distributed
from partita.zero import AdamWConfig, DataParallel, MixedPrecision, ZeroConfig
from tests.dist import dp_cases as zp

STAGES = (0, 1, 2, 3)


def _engine(mesh: Mesh, stage: int, seed: int = 0, frozen: str = "") -> DataParallel:
    torch.manual_seed(seed)
    model = zp.Toy().to(torch.float64)
    if frozen:
        model.get_submodule(frozen).requires_grad_(False)
    return DataParallel(model, mesh, zero=ZeroConfig(stage=stage, bucket_mb=0.02),
                        precision=MixedPrecision(param_dtype=torch.float64),
                        optim=AdamWConfig(lr=1e-2, weight_decay=0.0), blocks=zp.ToyLayer)


def _train(dp: DataParallel, rank: int, world: int, steps: int = 2) -> None:
    for step in range(steps):
        local = zp.batch(step).chunk(world)[rank]
        dp.backward(zp.lm_loss(dp.module(local[:, :-1]), local))
        dp.finish_grad_sync()
        dp.step()
        dp.zero_grad()


def _refused(fn) -> str:
    try:
        fn()
    except PartitaError as exc:
        return str(exc)
    return ""


def _state_dict_after_step(rank: int, world: int, mesh: Mesh) -> dict:
    out = {}
    for stage in (1, 2):
        dp = _engine(mesh, stage)
        _train(dp, rank, world)
        read = {k: v.clone() for k, v in dp.module.state_dict().items()}  # no wait first
        dp.wait_params()
        now = dp.module.state_dict()
        out[stage] = sorted(k for k in now if not torch.equal(read[k], now[k]))
        dp.close()
    dp = _engine(mesh, 3)
    _train(dp, rank, world)
    out["3 at rest"] = _refused(dp.module.state_dict)
    with dp.gathered_parameters():
        whole = {k: v.clone() for k, v in dp.module.state_dict().items()}
    out["3 gathered"] = {k: tuple(v.shape) for k, v in whole.items()}
    out["3 expected"] = {k: tuple(v.shape) for k, v in zp.Toy().state_dict().items()}
    dp.close()
    return out


def _torch_optimizer(rank: int, world: int, mesh: Mesh) -> dict:
    out = {}
    for stage in STAGES:
        dp = _engine(mesh, stage)
        opt = torch.optim.AdamW(dp.module.parameters(), lr=1e-2)
        local = zp.batch(0).chunk(world)[rank]
        dp.backward(zp.lm_loss(dp.module(local[:, :-1]), local))
        dp.finish_grad_sync()
        out[stage] = _refused(opt.step)
        dp.zero_grad()
        dp.close()
    # Closed engines own nothing: the optimizer may step their former parameters.
    out["after close"] = _refused(opt.step)
    return out


def _replicas_start_equal(rank: int, world: int, mesh: Mesh) -> dict:
    out = {}
    for stage in STAGES:
        dp = _engine(mesh, stage, seed=rank)  # each rank draws other weights
        with dp.gathered_parameters():
            mine = torch.cat([p.detach().reshape(-1) for p in dp.module.parameters()])
        first = mine.clone()
        dist.broadcast(first, 0)
        torch.manual_seed(0)
        expected = torch.cat([p.detach().reshape(-1)
                              for p in zp.Toy().to(torch.float64).parameters()])
        out[stage] = (torch.equal(mine, first), torch.equal(mine, expected))
        dp.close()
    return out


def _mesh_rank(rank: int, world: int) -> dict:
    return {"wrong rank": _refused(lambda: Mesh(Layout(dp=world), world - 1 - rank, world)),
            "default rank": Mesh(Layout(dp=world), world_size=world).rank,
            "one process": Mesh(Layout()).rank}


def _freeze_after_wrapping(rank: int, world: int, mesh: Mesh) -> dict:
    out = {}
    for stage in STAGES:
        dp = _engine(mesh, stage)
        _train(dp, rank, world, steps=1)
        for p in dp.module.layers[1].parameters():
            p.requires_grad_(False)
        with dp.gathered_parameters():
            before = dp.module.layers[1].fc1.weight.detach().clone()
        out[stage] = _refused(lambda dp=dp: _train(dp, rank, world, steps=1))
        with dp.gathered_parameters():
            out[stage, "moved"] = not torch.equal(before, dp.module.layers[1].fc1.weight)
        dp.close()
    return out


def _unfreeze_after_wrapping(rank: int, world: int, mesh: Mesh) -> dict:
    out = {}
    for stage in STAGES:
        dp = _engine(mesh, stage, frozen="layers.1")
        _train(dp, rank, world, steps=1)
        dp.module.layers[1].requires_grad_(True)
        out[stage] = _refused(lambda dp=dp: _train(dp, rank, world, steps=1))
        dp.close()
    return out


def _wrapped_twice(rank: int, world: int, mesh: Mesh) -> dict:
    out = {}
    for stage in STAGES:
        first = _engine(mesh, stage)
        out[stage] = _refused(lambda first=first, stage=stage: DataParallel(
            first.module, mesh, zero=ZeroConfig(stage=stage), blocks=zp.ToyLayer))
        sub = _refused(lambda first=first: DataParallel(first.module.layers[0], mesh))
        _train(first, rank, world, steps=1)  # the first engine still trains
        first.close()
        if stage < 3:  # a closed ZeRO-3 engine leaves its parameters at rest (empty)
            again = DataParallel(first.module, mesh, zero=ZeroConfig(stage=stage),
                                 blocks=zp.ToyLayer)
            _train(again, rank, world, steps=1)
            again.close()
        out[stage, "submodule"] = sub
    return out


def _worker(rank: int, world: int) -> dict:
    mesh = Mesh(Layout(dp=world), rank, world)
    out = {}
    for name, check in (("state_dict", _state_dict_after_step),
                        ("torch_optimizer", _torch_optimizer),
                        ("replicas", _replicas_start_equal),
                        ("twice", _wrapped_twice),
                        ("freeze", _freeze_after_wrapping),
                        ("unfreeze", _unfreeze_after_wrapping)):
        # Another error (a misuse that is not caught ends deep in torch) fails only the
        # test of its own check.
        try:
            out[name] = check(rank, world, mesh)
        except Exception as exc:
            out[name] = {"crashed": f"{type(exc).__name__}: {exc}"}
    out["mesh"] = _mesh_rank(rank, world)
    return out


@pytest.fixture(scope="module")
def seen() -> list[dict]:
    return run_distributed(_worker, 2, timeout=240)


def test_state_dict_right_after_step_holds_the_updated_parameters(seen) -> None:
    for rank in seen:
        got = rank["state_dict"]
        assert got[1] == [] and got[2] == [], got
        assert "gathered_parameters" in got["3 at rest"]
        assert got["3 gathered"] == got["3 expected"]


def test_a_torch_optimizer_is_refused_where_the_engine_shards(seen) -> None:
    for rank in seen:
        got = rank["torch_optimizer"]
        assert got[0] == ""  # stage 0: .grad is the averaged gradient, as under DDP
        for stage in (1, 2, 3):
            assert "dp.step(lr)" in got[stage], (stage, got[stage])
        assert got["after close"] == ""


def test_replicas_start_from_the_first_ranks_weights(seen) -> None:
    for rank, got in enumerate(seen):
        for stage in STAGES:
            same_as_first, as_seed_0 = got["replicas"][stage]
            assert same_as_first and as_seed_0, (rank, stage)


def test_a_mesh_with_the_wrong_rank_is_refused(seen) -> None:
    for rank, got in enumerate(seen):
        assert "disagrees with torch.distributed" in got["mesh"]["wrong rank"]
        assert got["mesh"]["default rank"] == rank
        assert got["mesh"]["one process"] == 0


def test_a_mesh_over_several_processes_needs_a_process_group() -> None:
    with pytest.raises(PartitaError, match="init_process_group"):
        Mesh(Layout(dp=2), 0, 2)


def test_freezing_after_wrapping_is_refused_before_the_update(seen) -> None:
    for rank in seen:
        for stage in STAGES:
            assert "frozen (requires_grad=False) after DataParallel" in rank["freeze"][stage]
            assert not rank["freeze"][stage, "moved"], stage


def test_unfreezing_after_wrapping_is_refused(seen) -> None:
    # The engine left the frozen layer out of its buffers: once trainable, its gradient
    # would stay per replica and no step would ever update it.
    for rank in seen:
        for stage in STAGES:
            assert "unfrozen (requires_grad=True) after DataParallel" in rank["unfreeze"][stage]


def test_wrapping_a_module_twice_is_refused(seen) -> None:
    for rank in seen:
        for stage in STAGES:
            assert "wrapped twice" in rank["twice"][stage], stage
            assert "wrapped twice" in rank["twice"][stage, "submodule"], stage
