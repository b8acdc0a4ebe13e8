"""`parallelize` refuses a user's model and plan that tensor or pipeline parallelism
cannot run, on every rank alike and before any rank waits on another; a layout the
model can take still trains. The model is tests/unit/test_plan_checks.py's, written the
way a user writes one; each case trains one step when parallelize accepts it."""

from __future__ import annotations

import torch

from partita.config import load_config
from partita.errors import PartitaError
from partita.mesh import Mesh
from partita.parallelize import parallelize
from partita.testing import run_distributed, token_batch
from tests.unit.test_plan_checks import UserLM, user_plan

CASES = {
    # name: (layout overrides, model keywords, plan role dropped, the refusal's words)
    "tp2-tied": (["--parallel.tp=2"], dict(tie=True), "", "tok.weight and out.weight"),
    "pp2-tied": (["--parallel.pp=2", "--train.microbatches=2"], dict(tie=True), "",
                 "tok.weight (stage 0), out.weight (stage 1)"),
    "pp2-no-embed": (["--parallel.pp=2", "--train.microbatches=2"],
                     dict(pipeline_methods=False), "", "no embed() and no head()"),
    "tp2-no-rowwise": (["--parallel.tp=2"], {}, "blocks.*.mlp.down",
                       "blocks.0.mlp has no rowwise layer"),
    "tp2-no-role-k": (["--parallel.tp=2"], {}, "blocks.*.attn.k",
                      "blocks.0.attn.k in blocks.0.attn beside its split layers"),
    "pp2-fine": (["--parallel.pp=2", "--train.microbatches=2"], {}, "", None),
}


def _parallelize_and_step(rank: int, world: int, name: str) -> str | float:
    overrides, model_kw, drop, _ = CASES[name]
    cfg = load_config(None, ["--train.dtype=float64", "--train.global_batch=4",
                             "--data.seq_len=16", *overrides])
    mesh = Mesh(cfg.layout(world), rank, world)
    torch.manual_seed(0)
    try:
        pm = parallelize(UserLM(**model_kw).double(), user_plan(drop), cfg, mesh,
                         torch.device("cpu"))
    except PartitaError as exc:
        return str(exc)
    tokens = token_batch(0, 4, 16, 64)
    return pm.runner.train(tokens[:, :-1], tokens[:, 1:], cfg.train.microbatches)


def _every_case(rank: int, world: int) -> dict[str, str | float]:
    return {name: _parallelize_and_step(rank, world, name) for name in CASES}


def test_every_rank_refuses_what_it_cannot_run() -> None:
    ranks = run_distributed(_every_case, 2, timeout=90)
    for name, (_, _, _, expected) in CASES.items():
        for rank, got in enumerate(ranks):
            value = got[name]
            if expected is None:
                assert isinstance(value, float), f"{name} rank {rank}: {value}"
            else:
                assert isinstance(value, str) and expected in value, \
                    f"{name} rank {rank}: {value}"
