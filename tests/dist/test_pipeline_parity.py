"""Pipeline parallelism against one process (gloo, CPU): every schedule at pp=2 and pp=4,
interleaved with v=2, gradient accumulation (microbatches), tied embeddings, ZeRO-1/2
over data parallel, tensor (+ sequence) parallel, and dp2 x tp2 x pp2 on 8 ranks.

Float64, 10 optimizer steps: losses, gradient norms (before clipping) and a final
validation loss within 1e-10 relative of the reference — a gradient scaled by any
factor shows in the norm even where AdamW would hide it in the loss — and each stage's
final weights. One float32 case (losses, norms) within 1e-4. One world per size runs all of its cases (partita.testing.check_layouts).
"""

from __future__ import annotations

import pytest

from partita.testing import FLOAT32_TOL, Case, check_layouts
from tests.dist.pipeline_cases import pipeline_config

STEPS = 10
TIED = {"tie_embeddings": True}
GPT2_TIED = {"tie_embeddings": True, "flavour": "gpt2", "n_kv_heads": None}
DEEP = {"n_layers": 8}


def pipe(name: str, dtype: str = "float64", **settings) -> Case:
    cfg = pipeline_config(train={"dtype": dtype}, **settings)
    if dtype == "float32":
        return Case(name, cfg, tol=FLOAT32_TOL)
    return Case(name, cfg, params=True)  # float64: every stage's final weights too


TWO = [
    pipe("gpipe", schedule="gpipe"),
    pipe("1f1b", schedule="1f1b"),
    pipe("interleaved-v2", schedule="interleaved-1f1b", virtual_stages=2),
    pipe("zb-h1", schedule="zb-h1"),
    pipe("1f1b-one-microbatch", schedule="1f1b", microbatches=1),
    pipe("1f1b-accumulate-8", schedule="1f1b", microbatches=8),
    pipe("1f1b-tied", schedule="1f1b", model=TIED),
    pipe("zb-h1-gpt2-tied", schedule="zb-h1", model=GPT2_TIED),
    pipe("interleaved-tied", schedule="interleaved-1f1b", virtual_stages=2, model=TIED),
    pipe("1f1b-balanced-params", schedule="1f1b", model={"n_layers": 5}, pp_balance="params"),
    pipe("1f1b-fp32", schedule="1f1b", dtype="float32"),
]
FOUR = [
    pipe("pp4-gpipe", pp=4, schedule="gpipe"),
    pipe("pp4-1f1b", pp=4, schedule="1f1b", microbatches=8),
    pipe("pp4-interleaved-v2", pp=4, schedule="interleaved-1f1b", virtual_stages=2,
         model=DEEP),
    pipe("pp4-zb-h1", pp=4, schedule="zb-h1", microbatches=8),
    pipe("pp4-zb-h1-tied", pp=4, schedule="zb-h1", model=GPT2_TIED),
    pipe("dp2-pp2-zero0", dp=2, schedule="1f1b"),
    pipe("dp2-pp2-zero1-zb-tied", dp=2, zero_stage=1, schedule="zb-h1", model=GPT2_TIED),
    pipe("dp2-pp2-zero2-zb", dp=2, zero_stage=2, schedule="zb-h1"),
    pipe("dp2-pp2-zero2-interleaved-tied", dp=2, zero_stage=2, schedule="interleaved-1f1b",
         virtual_stages=2, model=TIED),
    pipe("dp2-pp2-zero1-interleaved", dp=2, zero_stage=1, schedule="interleaved-1f1b",
         virtual_stages=2),
    pipe("tp2-pp2", tp=2, schedule="1f1b"),
    pipe("tp2-sp-pp2-zb-tied", tp=2, sequence_parallel=True, schedule="zb-h1", model=TIED),
]
EIGHT = [
    pipe("3d-zero2-1f1b", dp=2, tp=2, zero_stage=2, schedule="1f1b", microbatches=2),
    pipe("3d-zero1-sp-interleaved-tied", dp=2, tp=2, zero_stage=1, sequence_parallel=True,
         schedule="interleaved-1f1b", virtual_stages=2, microbatches=2, model=TIED),
]


def test_two_stages_every_schedule():
    check_layouts(TWO, 2, STEPS, timeout=170)


def test_four_ranks_pp4_and_pp_with_dp_zero_and_tp():
    check_layouts(FOUR, 4, STEPS, timeout=170)


@pytest.mark.parametrize("world", [8])
def test_3d_dp2_tp2_pp2_on_eight_ranks(world):
    check_layouts(EIGHT, world, STEPS, timeout=170)
