"""A script driving `parallelize` and `DataParallel` itself, over 2 ranks: a model built
with its values from a different seed on each rank starts from global rank 0's at every
layout (tp, pp, cp, ep), a tp mesh around a plain module is refused, and so are a plan
whose patterns match no module at tp=2 and a pipeline step whose microbatches do not
divide the rows.

One spawned world runs every case; a PartitaError is returned as its message, so one
refusal does not end the others.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from partita.layout import Degrees
from partita.mesh import Mesh
from partita.models.transformer import build_model
from partita.parallelize import parallelize
from partita.sharding import shard_info
from partita.testing import parity_config, run_distributed
from partita.zero import AdamWConfig, DataParallel, MixedPrecision, ZeroConfig
from tests.dist.test_zero_misuse import _refused

LAYOUTS = {"tp": dict(tp=2), "pp": dict(pp=2), "cp": dict(cp=2),
           "ep": dict(dp=2, ep=2)}
MOE = dict(n_experts=4, moe_every=1)


def _model(cfg, seed: int):
    """The config's Transformer with its values, moved off the init rule by `seed`."""
    model = build_model(cfg.model_config(), "cpu", torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def _mismatch(pm, reference) -> list[str]:
    """Parameters whose local values are not the reference's slice of them."""
    full = dict(reference.named_parameters())
    wrong = []
    with pm.dp.gathered_parameters():
        for name, local in pm.module.named_parameters():
            info = shard_info(local, name)
            expected = full[info.name]
            for dim, start, stop in info.cuts:
                expected = expected.narrow(dim, start, stop - start)
            if not torch.equal(local.detach(), expected):
                wrong.append(name)
    return wrong


def _cases(rank: int, world: int) -> dict:
    out: dict = {}
    for key, parallel in LAYOUTS.items():
        cfg = parity_config(parallel=parallel, train=dict(microbatches=2),
                            model=MOE if key == "ep" else {})
        mesh = Mesh(cfg.layout(world), rank, world)
        torch.manual_seed(rank)  # as a script that seeds by rank would
        model = _model(cfg, seed=rank)
        pm = parallelize(model, model.plan(), cfg, mesh, torch.device("cpu"))
        out[key] = _mismatch(pm, _model(cfg, seed=0))
        if key == "pp":  # the pipeline's runner weighs microbatches like the others
            rows = torch.zeros((4, 8), dtype=torch.long)
            out["pp_microbatches"] = _refused(
                lambda runner=pm.runner, rows=rows: runner.train(rows, rows, 3))
        pm.dp.close()

    cfg = parity_config(parallel=dict(tp=2))
    mesh = Mesh(cfg.layout(world), rank, world)
    model = build_model(cfg.model_config(), "meta")
    plan = model.plan()
    typo = {k.replace("blocks.", "block."): v for k, v in plan.roles.items()}
    out["typo"] = _refused(lambda: parallelize(model, dataclasses.replace(plan, roles=typo),
                                               cfg, mesh, torch.device("cpu")))

    plain = build_model(cfg.model_config(), "cpu", torch.float64)
    out["tp_mesh"] = _refused(lambda: DataParallel(
        plain, Mesh(Degrees(tp=2), rank, world), zero=ZeroConfig(stage=1),
        precision=MixedPrecision(param_dtype=torch.float64), optim=AdamWConfig()))
    out["pp_mesh"] = _refused(lambda: DataParallel(
        plain, Mesh(Degrees(pp=2), rank, world), zero=ZeroConfig(stage=1),
        precision=MixedPrecision(param_dtype=torch.float64), optim=AdamWConfig()))
    return out


@pytest.fixture(scope="module")
def seen() -> list[dict]:
    return run_distributed(_cases, 2, timeout=300)


def test_every_rank_starts_from_the_first_ranks_values(seen):
    """At tp=2 the norms and row-parallel biases kept each rank's own values, and at pp=2
    and ep=2 whole stages and experts did: the model matched no single-device one."""
    for rank, out in enumerate(seen):
        for layout in LAYOUTS:
            assert out[layout] == [], f"{layout}, rank {rank}"


def test_a_plan_whose_patterns_match_nothing_is_refused_at_tp2(seen):
    """Every block role misspelt left the blocks whole on both tp ranks, silently."""
    for out in seen:
        assert "match no module of Transformer: 'block.*" in out["typo"]
        assert "closest modules: blocks.*." in out["typo"]


def test_a_tp_mesh_around_a_plain_module_is_refused(seen):
    """Each tp rank trained its own copy, and the copies drifted apart."""
    for out in seen:
        assert "the mesh has tp=2 but Transformer carries no tensor-parallel" in out["tp_mesh"]
        assert "parallelize" in out["tp_mesh"]


def test_a_pp_mesh_around_an_uncut_module_is_refused(seen):
    """Each pipeline rank trained a whole copy of its own; nothing marked the model uncut."""
    for out in seen:
        assert "the mesh has pp=2 but Transformer is whole" in out["pp_mesh"]
        assert "pipeline runner" in out["pp_mesh"]


def test_the_pipeline_runner_refuses_microbatches_that_do_not_divide_the_rows(seen):
    """4 rows in 3 microbatches crashed the stage (IndexError) and left its peer waiting."""
    for out in seen:
        assert "3 microbatches do not divide this rank's batch of 4 rows" in \
            out["pp_microbatches"]
