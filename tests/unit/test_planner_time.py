"""Planner time model: bubbles, communication volumes, compute, against hand arithmetic."""

import pytest

from partita.planner import Assumptions, Cluster, Layout, get_gpu, resolve_model, step_time
from partita.planner.timing import layer_forward_flops

H100 = get_gpu("H100")
MODEL = resolve_model("llama3-8b")
SEQ = 4096


def _time(layout, gpus=None, batch=64, **assume):
    cluster = Cluster(H100, gpus or layout.world_size, 8)
    return step_time(MODEL, layout, cluster, SEQ, batch, assumptions=Assumptions(**assume))


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 16), (8, 8)])
def test_1f1b_bubble(pp, m):
    t = _time(Layout(pp=pp), batch=m)
    assert t["bubble_fraction"] == pytest.approx((pp - 1) / (m + pp - 1))


def test_interleaved_and_zero_bubble():
    pp, v, m = 4, 2, 16
    t = _time(Layout(pp=pp, virtual_stages=v, schedule="interleaved-1f1b"), batch=m)
    units = (pp - 1) / v
    assert t["bubble_fraction"] == pytest.approx(units / (m + units))
    zb = _time(Layout(pp=pp, schedule="zb-h1"), batch=m)
    assert zb["bubble_fraction"] == pytest.approx((pp - 1) / 3 / (m + (pp - 1) / 3))
    assert _time(Layout(), batch=m)["bubble_fraction"] == 0


def test_data_parallel_volume_per_zero_stage():
    p2 = 2 * MODEL.config.num_params()  # bf16 bytes of the whole model
    frac = 7 / 8
    z0 = _time(Layout(dp=8), batch=64)
    assert z0["dp_bytes"] == pytest.approx(2 * frac * p2)  # one all-reduce per step
    z1 = _time(Layout(dp=8, zero_stage=1), batch=64)
    assert z1["dp_bytes"] == pytest.approx(2 * frac * p2)  # reduce-scatter + all-gather
    m = 64 // 8
    z2 = _time(Layout(dp=8, zero_stage=2), batch=64)
    assert z2["dp_bytes"] == pytest.approx(frac * p2 * (m + 1))  # RS per microbatch
    z3 = _time(Layout(dp=8, zero_stage=3), batch=64)
    assert z3["dp_bytes"] == pytest.approx(3 * frac * p2 * m)  # AG fwd + AG bwd + RS


def test_tensor_and_pipeline_volumes():
    t = _time(Layout(tp=4, dp=2, sequence_parallel=True), batch=16)
    act = 2 * SEQ * MODEL.config.dim  # one microbatch's hidden states, bf16
    m = 16 // 2
    assert t["tp_bytes"] == pytest.approx(4 * 2 * 3 / 4 * act * MODEL.config.n_layers * m)
    p = _time(Layout(pp=4, tp=2, sequence_parallel=True), batch=8)
    assert p["pp_bytes"] == pytest.approx(2 * 8 * act / 2)  # fwd + bwd per microbatch, sp


def test_context_parallel_ring_volume():
    t = _time(Layout(cp=4, dp=2), batch=16)
    kv = 2 * 2 * SEQ / 4 * 8 * 128  # this rank's K and V, bf16
    assert t["cp_bytes"] == pytest.approx(3 * 3 * kv * MODEL.config.n_layers * 8)


def test_single_gpu_compute_and_mfu():
    a = Assumptions(matmul_half_rows=0, matmul_half_cols=0, compute_efficiency=0.5)
    cluster = Cluster(H100, 1, 8)
    t = step_time(MODEL, Layout(), cluster, SEQ, 4, assumptions=a)
    c = MODEL.config
    flops = 4 * (3 * c.n_layers * layer_forward_flops(MODEL, SEQ, 1)
                 + 3 * 2 * c.vocab_size * c.dim * SEQ)
    assert t["compute_s"] == pytest.approx(flops / (0.5 * H100.peak_flops))
    assert t["step_s"] == pytest.approx(t["compute_s"])
    # MFU counts model FLOPs (6N + 12LHQT per token): close to the efficiency.
    assert t["mfu"] == pytest.approx(0.5, rel=0.01)
    full = step_time(MODEL, Layout(recompute="full"), cluster, SEQ, 4, assumptions=a)
    assert full["mfu"] == pytest.approx(0.5 * 3 / 4, rel=0.02)  # one forward recomputed


def test_inter_node_links_are_slower():
    intra = _time(Layout(dp=8), batch=64)
    inter = _time(Layout(dp=16), gpus=16, batch=64)
    assert inter["dp_bytes"] > intra["dp_bytes"]
    per_byte_intra = intra["comm_exposed_s"] / intra["dp_bytes"]
    per_byte_inter = inter["comm_exposed_s"] / inter["dp_bytes"]
    assert per_byte_inter > per_byte_intra
