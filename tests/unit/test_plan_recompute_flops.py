"""Hardware FLOPs count what the step time reruns: the recomputed blocks only
(`recompute_layers`), twice under a zero-bubble split, and each kind of block (dense,
MoE with its router and shared experts) at its own forward FLOPs."""

import pytest

from partita.layout import parse_layout
from partita.planner import evaluate_layout, make_request
from partita.planner.model_shape import parse_model_shape

# llama3-70b: h 8192, kv 1024, ffn 28672, 80 layers; seq 8192.
H, KV, FFN, SEQ, LAYERS = 8192, 1024, 28672, 8192, 80
LLAMA70_BLOCK_FWD = 2 * (2 * H * H + 2 * H * KV + 3 * H * FFN) + 4 * H * SEQ  # per token


def _recomputed_flops_per_token(model, gpus: int, layout: str, **request) -> float:
    """Hardware minus model FLOPs of a step, per token of the step."""
    t = evaluate_layout(model, gpus, parse_layout(layout, gpus), **request).time
    req = make_request(model, gpus, **request)
    tokens = req.global_batch * req.seq_len
    per_gpu = t["hardware_flops_per_gpu"] - t["model_flops_per_gpu"]
    return per_gpu * t["step_s"] * gpus / tokens


def _hfu_over_mfu(model, gpus: int, layout: str, **request) -> float:
    t = evaluate_layout(model, gpus, parse_layout(layout, gpus), **request).time
    return t["hfu"] / t["mfu"]


LLAMA70 = "dp=2 tp=8 pp=4 zero_stage=1 microbatch_size=1 recompute=full"


def test_recompute_layers_reruns_only_those_blocks():
    # 1 of each stage's 20 blocks reruns: 4 blocks of 80.
    extra = _recomputed_flops_per_token("llama3-70b", 64, LLAMA70 + " recompute_layers=1")
    assert extra == pytest.approx(4 * LLAMA70_BLOCK_FWD, rel=1e-9)
    assert _hfu_over_mfu("llama3-70b", 64, LLAMA70 + " recompute_layers=1") == \
        pytest.approx(1.0166, abs=1e-3)
    # All of them by default.
    assert _recomputed_flops_per_token("llama3-70b", 64, LLAMA70) == \
        pytest.approx(LAYERS * LLAMA70_BLOCK_FWD, rel=1e-9)


def test_zero_bubble_reruns_the_forward_twice():
    extra = _recomputed_flops_per_token("llama3-70b", 64, LLAMA70 + " schedule=zb-h1")
    assert extra == pytest.approx(2 * LAYERS * LLAMA70_BLOCK_FWD, rel=1e-9)
    assert _hfu_over_mfu("llama3-70b", 64, LLAMA70 + " schedule=zb-h1") == \
        pytest.approx(1.658, abs=1e-3)
    # Selective recompute reruns the attention core, also in I and in W.
    sel = _recomputed_flops_per_token("llama3-70b", 64,
                                      LLAMA70.replace("full", "selective") + " schedule=zb-h1")
    assert sel == pytest.approx(2 * LAYERS * 4 * H * SEQ, rel=1e-9)


def test_mixed_dense_and_moe_blocks_each_count_their_own_forward():
    shape = ("layers=32,hidden=4096,heads=32,kv_heads=8,vocab=32000,seq=4096,ffn=14336,"
             "num_experts=8,top_k=2,moe_every=2")
    model = parse_model_shape(shape)
    h, kv, ffn, seq, experts = 4096, 1024, 14336, 4096, 8
    attention = 2 * (2 * h * h + 2 * h * kv) + 4 * h * seq
    dense = attention + 2 * 3 * h * ffn
    moe = attention + 2 * (h * experts + 2 * 3 * h * ffn)  # router, top_k=2 experts
    layout = "dp=64 ep=8 zero_stage=1 microbatch_size=1 recompute=full"
    extra = _recomputed_flops_per_token(model, 64, layout)
    assert extra == pytest.approx(16 * dense + 16 * moe, rel=1e-9)
    assert _hfu_over_mfu(model, 64, layout) == pytest.approx(1.329, abs=1e-3)


def test_shared_experts_are_part_of_the_recomputed_forward():
    # deepseek-v3-like: h 7168, 128 heads of 56, 256 experts of width 2048, top 8, one
    # shared expert, every block MoE; 61 blocks, 3 per stage at pp=16 (all rerun).
    h, kv, expert_ffn, seq = 7168, 128 * 56, 2048, 4096
    block = (2 * (2 * h * h + 2 * h * kv + h * 256 + (8 + 1) * 3 * h * expert_ffn)
             + 4 * h * seq)
    layout = "dp=16 pp=16 ep=8 virtual_stages=3 zero_stage=1 microbatch_size=1 recompute=full"
    extra = _recomputed_flops_per_token("deepseek-v3-like", 256, layout)
    assert extra == pytest.approx(61 * block, rel=1e-9)
    assert _hfu_over_mfu("deepseek-v3-like", 256, layout) == pytest.approx(1.326, abs=1e-3)
