"""Planner time model: bubbles, communication volumes, compute, against hand arithmetic."""

import pytest

from partita.errors import PartitaError
from partita.planner import (
    Assumptions,
    Cluster,
    Layout,
    evaluate,
    get_gpu,
    resolve_model,
    step_time,
)
from partita.planner.flops import layer_forward_flops

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


def test_compiled_blocks_leave_zero_bubble_nothing_to_defer():
    """A compiled block's weight gradients come with its input gradient (one backward
    node), so ZB-H1 idles as 1F1B does; the simulated schedule agrees."""
    from partita.pipeline.schedules import build_schedule
    from partita.pipeline.simulate import Costs, simulate

    pp, m = 4, 16
    cluster = Cluster(H100, pp, 8)
    compiled = step_time(MODEL, Layout(pp=pp, schedule="zb-h1"), cluster, SEQ, m,
                         compile="blocks")
    assert compiled["bubble_fraction"] == pytest.approx((pp - 1) / (m + pp - 1))
    whole_backward = simulate(build_schedule("zb-h1", pp, m, 1), Costs(I=2.0, W=0.0))
    assert whole_backward.makespan == 3 * (m + pp - 1)
    # Fully recomputed compiled blocks do defer W, at the price of a second whole backward.
    recomputed = Layout(pp=pp, schedule="zb-h1", recompute="full")
    eager_rc = step_time(MODEL, recomputed, cluster, SEQ, m)
    compiled_rc = step_time(MODEL, recomputed, cluster, SEQ, m, compile="blocks")
    assert compiled_rc["bubble_fraction"] == pytest.approx(eager_rc["bubble_fraction"], 0.05)
    assert compiled_rc["compute_s"] > 1.2 * eager_rc["compute_s"]


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
    """Per layer and microbatch: (c-1) K forward, (c-1) K + c K of gradients backward
    (docs/context_parallel.md); the all-gather kind (c-1) K each way plus (c-1) K."""
    t = _time(Layout(cp=4, dp=2), batch=16)
    kv = 2 * 2 * SEQ / 4 * 8 * 128  # this rank's K and V, bf16
    assert t["cp_bytes"] == pytest.approx((3 + 3 + 4) * kv * MODEL.config.n_layers * 8)
    g = _time(Layout(cp=4, dp=2, cp_kind="allgather"), batch=16)
    assert g["cp_bytes"] == pytest.approx((3 + 3 + 3) * kv * MODEL.config.n_layers * 8)


def test_context_parallel_volume_under_recompute():
    """Full recompute sends the forward's keys and values once more for each recomputed
    layer (twice under ZB-H1: I and W each rerun); selective reruns no cp core."""
    kv = 2 * 2 * SEQ / 4 * 8 * 128
    layers, m = MODEL.config.n_layers, 8
    full = _time(Layout(cp=4, dp=2, recompute="full"), batch=16)
    assert full["cp_bytes"] == pytest.approx((3 + 3 + 3 + 4) * kv * layers * m)
    first = _time(Layout(cp=4, dp=2, recompute="full", recompute_layers=1), batch=16)
    assert first["cp_bytes"] == pytest.approx(((3 + 3 + 4) * layers + 3) * kv * m)
    sel = _time(Layout(cp=4, dp=2, recompute="selective"), batch=16)
    assert sel["cp_bytes"] == _time(Layout(cp=4, dp=2), batch=16)["cp_bytes"]
    assert sel["step_s"] == _time(Layout(cp=4, dp=2), batch=16)["step_s"]


def test_context_parallel_time_overlaps_the_ring_not_the_gather():
    """The ring hides each hop behind one step of attention pieces; the all-gather kind
    waits for its collectives. So on a slow link (cp spread over nodes) the ring's
    exposed time is below the all-gather's, and on a fast one both shrink."""
    ring = _time(Layout(cp=4, dp=2), batch=16)
    gather = _time(Layout(cp=4, dp=2, cp_kind="allgather"), batch=16)
    assert ring["comm_exposed_s"] < gather["comm_exposed_s"]
    assert ring["step_s"] < gather["step_s"]


def test_single_gpu_compute_and_mfu():
    """Compute-bound GEMMs only (no tiles, no launch cost, infinite bandwidth): the step
    is the FLOPs at the GEMM rate, and MFU equals that rate's share of peak."""
    from dataclasses import replace

    a = Assumptions(gemm_peak_fraction=0.5, gemm_tile=0, gemm_k_half=0, kernel_overhead_s=0,
                    flash_fwd_fraction=1.0, flash_bwd_fraction=1.0, optimizer_bytes_per_param=0)
    fast = replace(H100, memory_bandwidth=1e30)
    cluster = Cluster(fast, 1, 8)
    t = step_time(MODEL, Layout(), cluster, SEQ, 4, assumptions=a)
    c = MODEL.config
    # Causal flash attention does half the score/value FLOPs that MFU counts, and its
    # backward recomputes the scores: 2.5x the forward, not 2x.
    attn = 4 * c.dim * SEQ * SEQ
    gemms = layer_forward_flops(MODEL, SEQ, 1) - attn
    flops = 4 * (c.n_layers * (3 * gemms + 3.5 * attn / 2)
                 + 3 * 2 * c.vocab_size * c.dim * SEQ)
    assert t["compute_s"] == pytest.approx(flops / (0.5 * H100.peak_flops), rel=1e-6)
    assert t["step_s"] == pytest.approx(t["compute_s"])
    full = step_time(MODEL, Layout(recompute="full"), cluster, SEQ, 4, assumptions=a)
    # Recomputation: MFU falls, hardware FLOPs (which count the repeat) stay put.
    assert full["mfu"] < t["mfu"]
    assert full["hfu"] == pytest.approx(t["hfu"], rel=0.05)


def test_bigger_hidden_reaches_higher_mfu():
    """Memory-bound work grows as h per token, GEMM FLOPs as h^2; and wider GEMMs run
    closer to peak: MFU rises with the hidden size at a fixed depth and sequence."""
    from partita.models.model_config import ModelConfig
    from partita.planner import PlanModel

    mfu = []
    for dim in (1024, 2048, 4096, 8192, 16384):
        model = PlanModel("w", ModelConfig(vocab_size=32000, dim=dim, n_layers=8,
                                           n_heads=dim // 128, max_seq_len=4096))
        mfu.append(step_time(model, Layout(), Cluster(H100, 1, 8), SEQ, 8)["mfu"])
    assert mfu == sorted(mfu) and mfu[-1] > 1.2 * mfu[0]


def test_tp_comm_overlap_hides_tensor_parallel_time():
    base = _time(Layout(tp=8, sequence_parallel=True), batch=8)
    over = _time(Layout(tp=8, sequence_parallel=True, tp_comm_overlap=True), batch=8)
    assert over["step_s"] < base["step_s"] and over["tp_bytes"] == base["tp_bytes"]
    no_grad = _time(Layout(dp=8, overlap_grad_reduce=False), gpus=8, batch=64)
    grad = _time(Layout(dp=8), gpus=8, batch=64)
    assert no_grad["step_s"] > grad["step_s"]


def test_inter_node_links_are_slower():
    intra = _time(Layout(dp=8), batch=64)
    inter = _time(Layout(dp=16), gpus=16, batch=64)
    assert inter["dp_bytes"] > intra["dp_bytes"]
    per_byte_intra = intra["comm_exposed_s"] / intra["dp_bytes"]
    per_byte_inter = inter["comm_exposed_s"] / inter["dp_bytes"]
    assert per_byte_inter > per_byte_intra


def test_unfused_gradient_accumulation_costs_a_memory_pass_per_microbatch():
    """`grad_accum_bytes_per_param` bytes per local parameter move after every
    microbatch, at memory speed: per stage and microbatch, so m times per step."""
    from partita.planner.stage_params import stage_param_counts

    layout, batch, nbytes = Layout(pp=2, dp=2), 16, 18.0
    base = _time(layout, batch=batch)
    slow = _time(layout, batch=batch, grad_accum_bytes_per_param=nbytes)
    a = Assumptions()
    params = max(sum(stage_param_counts(MODEL, layout, st, a).values()) for st in range(2))
    per_mb = nbytes * params / (H100.memory_bandwidth * a.memory_efficiency)
    m = batch // 2
    # The last stage (head and most parameters) paces all m + pp - 1 pipeline steps.
    assert slow["step_s"] - base["step_s"] == pytest.approx((m + 1) * per_mb, rel=1e-9)
    assert slow["compute_s"] - base["compute_s"] == pytest.approx(m * per_mb, rel=1e-9)


def test_zero3_kept_units_save_their_second_gather_and_hold_their_memory():
    from partita.planner.memory import comm_buffer_bytes
    from partita.planner.report import train_command
    from partita.planner.zero_buffers import zero3_buffers

    layout, m, p = Layout(dp=8, zero_stage=3), 64 // 8, 2  # bf16 parameters
    units = zero3_buffers(MODEL, layout)["units"]
    assert len(units) > 2
    base = _time(layout, zero3_kept_units=0)
    for k in (1, 2, len(units), 10 * len(units)):
        kept = sum(units[-k:])
        t = _time(layout, zero3_kept_units=k)
        assert base["dp_bytes"] - t["dp_bytes"] == pytest.approx(m * 7 / 8 * p * kept)
        gathered = comm_buffer_bytes(MODEL, layout, SEQ, assumptions=Assumptions(
            zero3_kept_units=k))["zero3_gathered"]
        one = comm_buffer_bytes(MODEL, layout, SEQ, assumptions=Assumptions(
            zero3_kept_units=1))["zero3_gathered"]
        # Held until backward: the kept units and the one prefetched before them, where
        # they outgrow the unit computing and the one prefetched in forward (the
        # largest: a unit, or the root's embedding on the first stage). Measured on the
        # tiny model's four units (2 ranks, one unit per block, bf16): root + 2, 2, 3
        # and 4 units gathered at most for keep_gathered 0, 1, 2 and 4.
        largest = max(max(units), MODEL.config.vocab_size * MODEL.config.dim)
        at_backward = kept + (largest if k < len(units) else 0.0)
        assert gathered - one == pytest.approx(p * max(0.0, at_backward - 2 * largest))
        if k >= len(units):
            assert gathered > one
    from partita.planner import make_request
    req = make_request("llama3-8b", 8, keep_gathered=3)
    ev = evaluate(req, layout)
    assert ev.kept_units == 3 and "--parallel.keep_gathered=3" in train_command(req, ev)
    # The plan assumed bf16 parameters; partita train's default would be fp32.
    assert "--precision.param_dtype=bfloat16" in train_command(req, ev)
    fp32 = make_request("llama3-8b", 8, precision="fp32")
    assert "param_dtype" not in train_command(fp32, evaluate(fp32, layout))
    assert ev.time["dp_bytes"] < evaluate(make_request("llama3-8b", 8, keep_gathered=1),
                                          layout).time["dp_bytes"]
    for keep in (None, 1):
        req = make_request("llama3-8b", 8, keep_gathered=keep)
        assert "keep_gathered" not in train_command(req, evaluate(req, layout))
    assert evaluate(req, Layout(dp=8, zero_stage=2)).kept_units is None  # ZeRO-3 only


def test_keep_gathered_auto_keeps_the_most_units_that_fit():
    from partita.planner import make_request
    from partita.planner.zero_buffers import zero3_buffers

    layout = Layout(dp=8, zero_stage=3)
    n = len(zero3_buffers(MODEL, layout)["units"])
    roomy = evaluate(make_request("llama3-8b", 8, gpu_type="H200", seq_len=1024,
                                  global_batch=8, keep_gathered="auto"), layout)
    assert roomy.fits and roomy.kept_units == n
    # An H100 at a longer sequence: activations leave room for only some units.
    req = make_request("llama3-8b", 8, seq_len=8192, global_batch=8, keep_gathered="auto")
    tight = evaluate(req, layout)
    assert 1 <= tight.kept_units < n
    more = make_request("llama3-8b", 8, seq_len=8192, global_batch=8,
                        keep_gathered=tight.kept_units + 1)
    assert tight.fits and not evaluate(more, layout).fits
    with pytest.raises(PartitaError):
        make_request("llama3-8b", 8, keep_gathered=-1)


def test_a_misaligned_gemm_runs_at_a_fifth_of_the_rate():
    """bf16 on an H200 (tools/gemm_sweep.py, 2026-12-04): 8192 x N x 8192 ran at 139
    TFLOP/s with N = 8191 or 8193 and 700 with N = 8256; a leading dimension off a
    multiple of 8 elements loses the vectorised tensor-core kernels. CPUs have no such
    step (the `cpu` preset leaves it out)."""
    from partita.planner.compute import gemm_time

    a = Assumptions()
    aligned = gemm_time(8192, 8192, 8192, H100, a)
    for n, k in ((8193, 8192), (8192, 8191)):  # (n = 8193 also fills one more tile row)
        assert gemm_time(8192, n, k, H100, a) == pytest.approx(5 * aligned, rel=0.02)
    assert gemm_time(8191, 8192, 8192, H100, a) == pytest.approx(aligned, rel=0.01)
    cpu = Assumptions.measured_cpu()
    assert gemm_time(512, 513, 512, H100, cpu) == pytest.approx(
        gemm_time(512, 512, 512, H100, cpu), rel=0.01)


def test_an_unpadded_vocabulary_is_named_with_its_padding():
    import dataclasses

    from partita.models.catalog import MODELS
    from partita.planner.api import make_request
    from partita.planner.evaluate import evaluate
    from partita.planner.model_shape import PlanModel
    from partita.planner.report import format_evaluation

    def note(model, layout):
        req = make_request(model, 1024, "A100-80GB", seq_len=2048, global_batch=1536)
        return format_evaluation(req, evaluate(req, layout))

    layout = Layout(tp=8, pp=8, dp=16)
    gpt3 = MODELS["gpt3-175b"]
    unpadded = PlanModel("gpt3-unpadded", dataclasses.replace(gpt3, vocab_multiple=1))
    text = note(unpadded, layout)
    assert "vocabulary 50,257 over tp=8" in text and "Pad it to 50,304" in text
    assert "--model.vocab_multiple=64" in text
    # The catalog's GPT-3 is padded (50,304 rows: 6,288 per rank at tp 8): no note, and
    # its output layer is charged at the aligned rate.
    assert "Pad it" not in note("gpt3-175b", layout)
    assert "padded" not in note("llama3-8b", layout)
    # Padded, yet off the alignment once split: 50,304 / 32 = 1,572 rows per rank.
    wide = Layout(tp=32, pp=2, dp=16)
    text = note(PlanModel("gpt3-tp32", dataclasses.replace(gpt3, n_heads=128)), wide)
    assert "vocabulary 50,257 (padded to 50,304) over tp=32" in text
    assert "--model.vocab_multiple=256" in text and "Pad it to 50,432" in text
