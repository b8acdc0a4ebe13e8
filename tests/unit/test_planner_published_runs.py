"""The planner's step time against published large-scale runs (tests.unit.planner_published_runs.py).

Prints the error of every row (run pytest with -s to see the table). Asserts what the
model achieves today, so a change that makes it worse fails: the median error, the
largest error, and every published ordering of two layouts on the same hardware.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from partita.layout import Layout
from partita.models.model_config import ModelConfig
from partita.planner import Assumptions, Cluster, PlanModel, Precision, get_gpu, step_time
from tests.unit.planner_published_runs import KORTHIKANTI, ORDERINGS, RUNS, Run

# What the model reaches on the table today (docs/planner.md, README): median 4.4%,
# 26 of 29 rows within 15%; the three others are MT-NLG's (up to 27.5%). The target of
# every row within 15% is not met; the bounds below say what is.
MEDIAN_BOUND = 0.05
WITHIN_15 = 26
WORST_BOUND = 0.28


def predict(run: Run) -> dict[str, float]:
    cfg = ModelConfig(vocab_size=run.vocab, dim=run.hidden, n_layers=run.layers,
                      n_heads=run.heads, n_kv_heads=run.kv_heads, ffn_dim=run.ffn,
                      max_seq_len=run.seq, flavour=run.flavour, dropout=run.dropout,
                      tie_embeddings=run.flavour == "gpt2")
    layout = Layout(dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, zero_stage=run.zero_stage,
                    virtual_stages=run.virtual_stages,
                    schedule="interleaved-1f1b" if run.virtual_stages > 1 else "1f1b",
                    microbatch_size=run.microbatch, sequence_parallel=run.sequence_parallel,
                    recompute=run.recompute, tp_comm_overlap=run.tp_comm_overlap,
                    overlap_grad_reduce=run.overlap_grad_reduce,
                    overlap_param_gather=run.overlap_param_gather)
    a = Assumptions(attention_kernel=run.attention,
                    grad_accum_bytes_per_param=run.grad_accum_bytes)
    if run.blocking_p2p:
        a = replace(a, pp_overlap=0.0)
    gpu = get_gpu(run.gpu)
    if run.inter_node_bandwidth is not None:
        gpu = replace(gpu, inter_node_bandwidth=run.inter_node_bandwidth)
    return step_time(PlanModel(run.name, cfg), layout, Cluster(gpu, run.gpus, 8), run.seq,
                     run.global_batch, Precision(grad=run.grad_bytes), a)


def throughput_error(run: Run) -> float:
    """Predicted throughput over measured, minus one (positive: the planner is faster)."""
    t = predict(run)
    if run.kind == "step_s":
        return run.measured / t["step_s"] - 1
    key = {"hw_tflops": "hardware_flops_per_gpu", "model_tflops": "model_flops_per_gpu"}
    return t[key[run.kind]] / (run.measured * 1e12) - 1


def error_table() -> list[tuple[Run, float]]:
    return [(run, throughput_error(run)) for run in RUNS]


def test_table_is_broad_enough():
    assert len(RUNS) >= 15
    assert len({r.source.split(",")[0] for r in RUNS}) >= 3
    assert len({r.gpu.split("-")[0] for r in RUNS}) >= 2
    assert len({r.name for r in RUNS}) == len(RUNS)


def test_error_per_row(capsys):
    rows = error_table()
    with capsys.disabled():
        print(f"\n{'run':<26} {'gpu':<10} {'layout':<28} {'measured':>10} {'error':>7}")
        for run, err in rows:
            lay = f"tp{run.tp} pp{run.pp} cp{run.cp} dp{run.dp} z{run.zero_stage} {run.recompute}"
            print(f"{run.name:<26} {run.gpu:<10} {lay:<28} {run.measured:>10g} {err:>+7.1%}")
        errors = [abs(e) for _, e in rows]
        print(f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}, "
              f"within 15%: {sum(e <= 0.15 for e in errors)}/{len(errors)}")
    errors = [abs(e) for _, e in rows]
    assert statistics.median(errors) <= MEDIAN_BOUND
    assert sum(e <= 0.15 for e in errors) >= WITHIN_15
    assert max(errors) <= WORST_BOUND


def test_rows_agree_with_their_papers_other_figures():
    """Where a paper reports a run twice (time and FLOP rate), the transcribed row and the
    other figure agree through the paper's own FLOP formula: a check on transcription."""
    by_name = {r.name: r for r in RUNS}
    # Korthikanti Table 5: MFU of selective + SP, model FLOPs 72 B s l h^2 (1 + s/6h + V/12lh).
    for name, mfu in (("22b", 41.5), ("175b", 51.4), ("530b", 56.0), ("1t", 56.3)):
        r = by_name[f"{name}-selective-sp"]
        flops = 72 * r.layers * r.hidden**2 * r.seq * (
            1 + r.seq / (6 * r.hidden) + r.vocab / (12 * r.layers * r.hidden))
        got = flops * r.global_batch / r.measured / r.gpus / 312e12
        assert got == pytest.approx(mfu / 100, abs=0.005), name
    # MT-NLG: TFLOP/s per GPU, hardware FLOPs 96 B s l h^2 (1 + s/6h + V/16lh).
    for nodes, tflops in ((280, 126), (350, 121), (420, 113)):
        r = by_name[f"mt-nlg-530b-{nodes}nodes"]
        flops = 96 * r.layers * r.hidden**2 * r.seq * (
            1 + r.seq / (6 * r.hidden) + r.vocab / (16 * r.layers * r.hidden))
        got = flops * r.global_batch / r.measured / r.gpus / 1e12
        assert got == pytest.approx(tflops, abs=1.0), nodes


def test_calibration_rows_and_held_out_rows():
    """The A100 GEMM rate (`compute.GEMM_PEAK_FRACTION`) is the one constant fitted to
    this table: on Korthikanti et al.'s Table 5 (median error ~0). The other sources are
    held out; their median error is what the model predicts unseen runs with."""
    rows = error_table()
    fitted = [e for r, e in rows if r.source == KORTHIKANTI]
    assert abs(statistics.median(fitted)) <= 0.01
    held_out = [abs(e) for r, e in rows if r.source != KORTHIKANTI]
    assert statistics.median(held_out) <= 0.06


@pytest.mark.parametrize("faster,slower", ORDERINGS)
def test_published_orderings(faster, slower):
    by_name = {r.name: r for r in RUNS}
    fast, slow = by_name[faster], by_name[slower]
    assert (fast.gpu, fast.gpus) == (slow.gpu, slow.gpus)
    t_fast, t_slow = predict(fast)["step_s"], predict(slow)["step_s"]
    # Same model and batch: the shorter step is the faster layout.
    assert t_fast < t_slow
