"""The host's floor on a GPU (`compute.host_times`): partita's eager operations are
launched by the host ahead of their kernels, so a microbatch takes the longer of the
GPU's work and the host's, and the optimizer step at least the host's launches. Checked
against partita's own steps measured on one H200 (docs/planner.md, "The host's floor")."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from partita.layout import Layout
from partita.planner.api import make_request
from partita.planner.assumptions import HOST_OP_S, Assumptions
from partita.planner.eager_ops import block_ops, edge_ops, step_ops
from partita.planner.evaluate import evaluate
from partita.planner.report import format_evaluation

PARTITA = Assumptions.partita_on_gpu()
NO_HOST = replace(PARTITA, host_op_s=0.0)
TORCH_LOSS_BYTES = 36.0

# `partita bench gpu --model M --batch B --seq S --rounds 2-4` on one H200 (torch
# 2.11.0+cu130, 2026-12-04, commit 3527754; docs/benchmarks.md): partita stage 0's eager
# step in ms, every reading of the day (the runner appears in two pairs, and some sizes
# ran twice). That engine interleaved decayed and undecayed parameters in its flat
# buffers: gpt2-124m's clipping and update ran about 700 views more than now, ~1 us of
# host time each, under 2% of these steps.
#
# The benchmark's loss is torch's cross-entropy on the bf16 logits cast to fp32, not
# partita's: 36 bytes per logit (the two casts 12, log-softmax forward 8, its gradient's
# zero-filled buffer 4, log-softmax backward 12; counted per operation with a
# TorchDispatchMode) against partita's 16, about 5 ms more at 16 x 1024 tokens of GPT-2.
# The comparison gives the plan the loss the benchmark ran.
MEASURED = [
    ("gpt2-124m", 1, 128, (37.5, 42.1, 40.3, 30.9, 34.3)),
    ("gpt2-124m", 8, 1024, (30.7, 35.2)),
    ("gpt2-124m", 16, 1024, (47.9, 48.5, 47.6, 50.7)),
    ("gpt2-124m", 32, 1024, (86.6, 88.9)),
    ("gpt2-124m", 64, 1024, (168.9, 169.5)),
    ("llama3.2-1b", 1, 128, (91.4,)),
    ("llama3.2-1b", 4, 2048, (183.6, 183.3, 181.1)),
]


def _eval(model: str, batch: int, seq: int, assumptions: Assumptions = PARTITA,
          compile: str = "none"):
    req = make_request(model, 1, "H200", seq_len=seq, global_batch=batch,
                       assumptions=assumptions, compile=compile)
    return req, evaluate(req, Layout(microbatch_size=batch))


def test_a_small_microbatch_is_paced_by_the_host():
    req, ev = _eval("gpt2-124m", 8, 1024)
    model = req.model
    fwd, bwd = block_ops(model, ev.layout, 2)
    edge = sum(edge_ops(model, 2))
    host = (model.config.n_layers * (fwd + bwd) + edge) * HOST_OP_S
    t = ev.time
    assert t["host_bound"] and t["host_s"] == pytest.approx(host)
    assert t["compute_s"] == pytest.approx(host)  # one microbatch, host-bound
    # After clipping the host launches the step's operations; the GPU's update is shorter.
    assert t["optimizer_s"] == pytest.approx(
        step_ops(model.total_params(), 2, PARTITA) * HOST_OP_S)
    assert "Note: host-bound" in format_evaluation(req, ev)
    # Without the floor the same step is predicted far shorter than the 30.7-35.2 ms
    # measured: the GPU's work alone.
    assert _eval("gpt2-124m", 8, 1024, NO_HOST)[1].time["step_s"] < 0.7 * t["step_s"]


def test_a_large_microbatch_is_paced_by_the_gpu():
    for model, batch, seq in (("gpt2-124m", 64, 1024), ("llama3.2-1b", 4, 2048)):
        req, ev = _eval(model, batch, seq)
        device = _eval(model, batch, seq, NO_HOST)[1].time
        assert not ev.time["host_bound"] and ev.time["host_s"] > 0
        assert ev.time["compute_s"] == pytest.approx(device["compute_s"])
        assert "host-bound" not in format_evaluation(req, ev)


def test_only_partitas_counted_operations_on_a_gpu_have_a_floor():
    # Other implementations' operations are not counted: no floor at any size.
    req = make_request("gpt2-124m", 1, "H200", seq_len=128, global_batch=1)
    ev = evaluate(req, Layout())
    assert ev.time["host_s"] == 0 and not ev.time["host_bound"]
    assert Assumptions().host_op_s == 0 and Assumptions.measured_cpu().host_op_s == 0


def test_compiled_blocks_keep_the_hosts_floor():
    # On the H200 a compiled GPT-2 block cost the host as much as the eager one
    # (compiled/eager 1.01-1.14 at 1 x 128 tokens): compiling does not lift the floor.
    eager = _eval("gpt2-124m", 8, 1024)[1].time
    blocks = _eval("gpt2-124m", 8, 1024, compile="blocks")[1].time
    assert blocks["host_bound"] and blocks["step_s"] == pytest.approx(eager["step_s"])


def test_predictions_against_the_h200_measurements(capsys):
    rows, errors = [], []
    for model, batch, seq, readings in MEASURED:
        bench = replace(PARTITA, loss_bytes_per_logit=TORCH_LOSS_BYTES)
        predicted = _eval(model, batch, seq, bench)[1].time["step_s"] * 1e3
        median = statistics.median(readings)
        error = predicted / median - 1
        errors.append(error)
        rows.append(f"{model:<12} {batch:>3} x {seq:<5} predicted {predicted:7.1f} ms, "
                    f"measured {min(readings):.1f}-{max(readings):.1f} ({error:+.1%})")
    with capsys.disabled():
        print("\n" + "\n".join(rows))
    # gpt2 at 8 x 1024 reads +8% (its host time varied most: 31-42 ms at 1 x 128), at 16
    # x 1024 -8%; every other size within 5%. Without the floor the two 1 x 128 rows
    # read -92% and -84%, gpt2 at 8 x 1024 -29%; with partita's own loss in the plan,
    # gpt2 at 16-64 x 1024 reads 10-17% short.
    assert all(abs(e) <= 0.1 for e in errors), errors
    assert statistics.median(abs(e) for e in errors) <= 0.06
