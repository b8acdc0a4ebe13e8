"""An MoE block's time includes its router and its shared experts: GEMMs every token
runs, which left out made DeepSeek-V3-like steps too fast."""

import dataclasses

import pytest

from partita.layout import Layout
from partita.planner.assumptions import Assumptions
from partita.planner.compute import block_times, gemm_time
from partita.planner.hardware import get_gpu
from partita.planner.model_shape import PlanModel, resolve_model

SEQ = 4096


def _without_shared(model: PlanModel) -> PlanModel:
    return PlanModel(model.name, dataclasses.replace(model.config, shared_experts=0),
                     model.moe)


@pytest.mark.parametrize("moe_tp,shared_t", [("replicate", 1), ("experts", 8)])
def test_shared_experts_add_their_gemms(moe_tp: str, shared_t: int):
    model = resolve_model("deepseek-v3-like")
    c = model.config
    assert c.shared_experts > 0 and c.gated_mlp
    layout = Layout(dp=8, tp=8, ep=8, microbatch_size=1, moe_tp=moe_tp)
    gpu, a = get_gpu("H100"), Assumptions()
    tokens, h = SEQ, c.dim
    width = c.shared_experts * model.expert_ffn
    gemms = [(tokens, 2 * width / shared_t, h), (tokens, h, width / shared_t)]
    fwd = sum(gemm_time(m, n, k, gpu, a) for m, n, k in gemms)
    bwd = sum(gemm_time(m, k, n, gpu, a) + gemm_time(k, n, m, gpu, a) for m, n, k in gemms)
    with_shared = block_times(model, layout, SEQ, gpu, a)
    without = block_times(_without_shared(model), layout, SEQ, gpu, a)
    assert with_shared.gemm_fwd - without.gemm_fwd == pytest.approx(fwd, rel=1e-9)
    assert with_shared.fwd - without.fwd > fwd  # and their elementwise work
    assert with_shared.bwd - without.bwd > bwd


def test_the_router_is_timed():
    model = _without_shared(resolve_model("deepseek-v3-like"))
    layout = Layout(dp=8, ep=8, microbatch_size=1)
    gpu, a = get_gpu("H100"), Assumptions()
    blk = block_times(model, layout, SEQ, gpu, a)
    router = gemm_time(SEQ, model.moe.num_experts, model.config.dim, gpu, a)
    kv = model.config.kv_heads * model.config.head_dim
    h = model.config.dim
    expert_rows = SEQ * model.moe.top_k * layout.ep / model.moe.num_experts
    ffn = model.expert_ffn
    others = (gemm_time(SEQ, h + 2 * kv, h, gpu, a) + gemm_time(SEQ, h, h, gpu, a)
              + model.moe.num_experts / layout.ep
              * (gemm_time(expert_rows, 2 * ffn, h, gpu, a) + gemm_time(expert_rows, h, ffn, gpu, a)))
    assert blk.gemm_fwd == pytest.approx(others + router, rel=1e-9)
