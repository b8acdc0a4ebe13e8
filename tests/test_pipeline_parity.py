"""Pipeline parallelism against one process (gloo, CPU): every schedule at pp=2 and pp=4,
interleaved with v=2, gradient accumulation (microbatches), tied embeddings, ZeRO-1/2
over data parallel, tensor (+ sequence) parallel, and dp2 x tp2 x pp2 on 8 ranks.

Float64, 10 optimizer steps: losses, gradient norms (before clipping) and a final
validation loss within 1e-10 relative of the reference — a gradient scaled by any
factor shows in the norm even where AdamW would hide it in the loss. One float32 case
within 1e-4. One world per size runs all of its cases.
"""

from __future__ import annotations

import pytest
from pipeline_cases import reference, run_cases, worst_relative

from partita.testing import run_distributed

STEPS = 10
TIED = {"tie_embeddings": True}
GPT2_TIED = {"tie_embeddings": True, "flavour": "gpt2", "n_kv_heads": None}
DEEP = {"n_layers": 8}

TWO = [
    dict(id="gpipe", schedule="gpipe"),
    dict(id="1f1b", schedule="1f1b"),
    dict(id="interleaved-v2", schedule="interleaved-1f1b", v=2),
    dict(id="zb-h1", schedule="zb-h1"),
    dict(id="1f1b-one-microbatch", schedule="1f1b", m=1),
    dict(id="1f1b-accumulate-8", schedule="1f1b", m=8),
    dict(id="1f1b-tied", schedule="1f1b", model=TIED),
    dict(id="zb-h1-gpt2-tied", schedule="zb-h1", model=GPT2_TIED),
    dict(id="interleaved-tied", schedule="interleaved-1f1b", v=2, model=TIED),
    dict(id="1f1b-balanced-params", schedule="1f1b", model={"n_layers": 5},
         parallel={"pp_balance": "params"}),
    dict(id="1f1b-fp32", schedule="1f1b", dtype="float32", tol=1e-4),
]
FOUR = [
    dict(id="pp4-gpipe", pp=4, schedule="gpipe"),
    dict(id="pp4-1f1b", pp=4, schedule="1f1b", m=8),
    dict(id="pp4-interleaved-v2", pp=4, schedule="interleaved-1f1b", v=2, model=DEEP),
    dict(id="pp4-zb-h1", pp=4, schedule="zb-h1", m=8),
    dict(id="pp4-zb-h1-tied", pp=4, schedule="zb-h1", model=GPT2_TIED),
    dict(id="dp2-pp2-zero0", dp=2, schedule="1f1b"),
    dict(id="dp2-pp2-zero1-zb-tied", dp=2, zero=1, schedule="zb-h1", model=GPT2_TIED),
    dict(id="dp2-pp2-zero2-zb", dp=2, zero=2, schedule="zb-h1"),
    dict(id="dp2-pp2-zero2-interleaved-tied", dp=2, zero=2, schedule="interleaved-1f1b",
         v=2, model=TIED),
    dict(id="dp2-pp2-zero1-interleaved", dp=2, zero=1, schedule="interleaved-1f1b", v=2),
    dict(id="tp2-pp2", tp=2, schedule="1f1b"),
    dict(id="tp2-sp-pp2-zb-tied", tp=2, sp=True, schedule="zb-h1", model=TIED),
]
EIGHT = [
    dict(id="3d-zero2-1f1b", dp=2, tp=2, zero=2, schedule="1f1b", m=2),
    dict(id="3d-zero1-sp-interleaved-tied", dp=2, tp=2, zero=1, sp=True,
         schedule="interleaved-1f1b", v=2, m=2, model=TIED),
]
for case in TWO + FOUR + EIGHT:
    case.setdefault("pp", 2)


def _check(world: int, cases: list[dict]) -> None:
    runs = run_distributed(run_cases, world, ([{k: v for k, v in c.items() if k != "id"}
                                               for c in cases], STEPS), timeout=170)
    failures = []
    for i, case in enumerate(cases):
        ref = reference(case, STEPS)
        for rank, results in enumerate(runs):
            err = worst_relative(results[i], ref)
            if not err <= case.get("tol", 1e-10):
                failures.append(f"{case['id']} rank {rank}: relative difference {err:.2e}")
        assert ref["losses"][-1] != ref["losses"][0]  # the run did train
    assert not failures, "\n".join(failures)


def test_two_stages_every_schedule():
    _check(2, TWO)


def test_four_ranks_pp4_and_pp_with_dp_zero_and_tp():
    _check(4, FOUR)


@pytest.mark.parametrize("world", [8])
def test_3d_dp2_tp2_pp2_on_eight_ranks(world):
    _check(world, EIGHT)
