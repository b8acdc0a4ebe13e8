"""Explicit-score attention: the same function as torch's fused kernel, chosen as stated.

`model.attention = "auto"` computes short bf16 sequences on a CPU with explicit scores
(`partita.models.attention_kernel`); these tests hold that path to the fused kernel's
results in float64, to the fused kernel's own bf16 error, and to the rule the planner
applies too.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from partita.errors import PartitaError
from partita.models import ModelConfig, build_model
from partita.models.attention_kernel import (
    BF16_UNITS,
    bf16_units_from_flags,
    explicit_scores_limit,
    uses_explicit_scores,
)
from partita.models.documents import attention_mask
from partita.models.transformer import AttentionCore, explicit_attention

SHAPES = [(2, 4, 2, 16, 8), (1, 6, 6, 10, 4), (3, 8, 1, 12, 16)]  # b, heads, kv, seq, d


def _inputs(b, heads, kv, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q as the model makes it: (b, s, heads, d) transposed, so not contiguous.
    q = torch.randn(b, s, heads, d, generator=g, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, kv, s, d, generator=g, dtype=dtype)
    v = torch.randn(b, kv, s, d, generator=g, dtype=dtype)
    segments = torch.tensor([[0] * (s // 3) + [1] * (s - s // 3)] * b)
    return [t.requires_grad_() for t in (q, k, v)], segments


def _fused(q, k, v, segments):
    if segments is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(segments),
                                          enable_gqa=True)


def _output_and_grads(fn, qkv, segments, grad):
    out = fn(*qkv, segments)
    return (out, *torch.autograd.grad(out, qkv, grad.to(out.dtype)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_explicit_scores_equal_the_fused_kernel_in_float64(shape, masked):
    qkv, segments = _inputs(*shape, torch.float64)
    segments = segments if masked else None
    grad = torch.randn(shape[0], shape[1], shape[3], shape[4], dtype=torch.float64)
    ours = _output_and_grads(explicit_attention, qkv, segments, grad)
    theirs = _output_and_grads(_fused, qkv, segments, grad)
    for name, a, b in zip(("output", "dq", "dk", "dv"), ours, theirs):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), name


@pytest.mark.parametrize("shape", SHAPES)
def test_explicit_scores_in_bf16_stay_within_two_bf16_steps_of_exact(shape):
    """bf16 explicit scores round the scores and the probabilities to bf16 (as the eager
    attention of Megatron-LM and transformers does), where the fused kernel accumulates
    in fp32: its error is larger, but stays within two bf16 steps (2^-6 relative) of
    each result's largest value, output and gradients. A lost scale, mask or group
    would be off by far more."""
    qkv, segments = _inputs(*shape, torch.bfloat16)
    grad = torch.randn(shape[0], shape[1], shape[3], shape[4], dtype=torch.float64)
    exact = _output_and_grads(_fused, [t.detach().double().requires_grad_() for t in qkv],
                              segments, grad)
    ours = _output_and_grads(explicit_attention, qkv, segments, grad)
    for name, e, a in zip(("output", "dq", "dk", "dv"), exact, ours):
        err, scale = (a.double() - e).abs().max().item(), e.abs().max().item()
        assert err <= scale * 2 ** -6, (name, err, scale)


@pytest.mark.parametrize("units", ["avx512", "amx"])
def test_auto_takes_explicit_scores_only_for_short_bf16_sequences_on_a_cpu(units):
    limit = explicit_scores_limit(units)
    assert uses_explicit_scores("auto", "cpu", "bfloat16", limit, units)
    assert not uses_explicit_scores("auto", "cpu", "bfloat16", limit + 1, units)
    assert not uses_explicit_scores("auto", "cpu", "float32", 16, units)
    assert not uses_explicit_scores("auto", "cuda", "bfloat16", 16, units)
    assert uses_explicit_scores("explicit", "cuda", "float32", 10 * limit, units)
    assert not uses_explicit_scores("sdpa", "cpu", "bfloat16", 16, units)
    # A CPU without bf16 instructions keeps torch's kernel; "explicit" is still obeyed.
    assert not uses_explicit_scores("auto", "cpu", "bfloat16", 16, "none")
    assert uses_explicit_scores("explicit", "cpu", "bfloat16", 16, "none")


def test_amx_crosses_over_to_torchs_kernel_sooner():
    """AMX speeds up torch's own flash kernel too, so explicit scores lead it over a
    shorter range there (docs/performance.md)."""
    assert 0 == explicit_scores_limit("none") < explicit_scores_limit("amx") \
        < explicit_scores_limit("avx512")


@pytest.mark.parametrize("flags, units", [
    ({"avx2", "avx512f"}, "none"), ({"avx512f", "avx512_bf16"}, "avx512"),
    ({"avx512_bf16", "amx_tile", "amx_bf16"}, "amx"), ({"fp", "asimd", "bf16"}, "none")])
def test_bf16_units_are_read_from_the_cpus_flags(flags, units):
    assert bf16_units_from_flags(flags) == units


def test_the_planner_refuses_an_unknown_kind_of_bf16_unit():
    from dataclasses import replace

    from partita.planner import Assumptions

    assert set(BF16_UNITS) == {"none", "avx512", "amx"}
    with pytest.raises(PartitaError, match="cpu_bf16_units='avx'.*'amx'"):
        replace(Assumptions(), cpu_bf16_units="avx")


def test_the_planner_counts_scores_only_where_the_model_takes_them():
    """The measured CPU preset applies the model's rule: kept bf16 scores on a CPU with
    bf16 units, a log-sum-exp per query without them, in fp32, and past the limit."""
    from dataclasses import replace

    from partita.layout import Layout
    from partita.planner import Assumptions
    from partita.planner.activation_memory import attention_score_bytes
    from partita.planner.model_shape import PlanModel
    from partita.planner.precision import Precision

    model = PlanModel("t", ModelConfig(dim=64, n_heads=4, n_kv_heads=2, max_seq_len=32))
    cpu, layout = Assumptions.measured_cpu(), Layout(microbatch_size=2)
    lse = 4.0 * 4 * 32 * 2  # fp32, per head and query
    assert attention_score_bytes(model, layout, 32, Precision(), cpu) == 2 * 4 * 32 * 32 * 2
    no_units = replace(cpu, cpu_bf16_units="none")
    assert attention_score_bytes(model, layout, 32, Precision(), no_units) == lse
    assert attention_score_bytes(model, layout, 32, Precision.fp32(), cpu) == lse
    long = explicit_scores_limit(cpu.cpu_bf16_units)  # 2 x 4 x 2048^2 per call: past it
    assert attention_score_bytes(model, layout, 2048, Precision(), cpu) == lse * 2048 / 32
    assert long < 2 * 4 * 2048 ** 2


@pytest.mark.parametrize("kernel, explicit", [("auto", True), ("sdpa", False),
                                              ("explicit", True)])
def test_the_core_calls_the_kernel_its_setting_names(kernel, explicit, monkeypatch):
    calls = []
    import partita.models.transformer as transformer

    real = transformer.explicit_attention
    monkeypatch.setattr(transformer, "explicit_attention",
                        lambda *a: calls.append(1) or real(*a))
    # On a CPU with bf16 units whichever this machine has.
    monkeypatch.setattr(transformer, "cpu_bf16_units", lambda: "avx512")
    (q, k, v), _ = _inputs(2, 4, 2, 16, 8, torch.bfloat16)
    AttentionCore(kernel)(q, k, v)
    assert bool(calls) == explicit


def test_a_model_in_bf16_trains_the_same_under_either_kernel_up_to_bf16_rounding():
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=16)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = {}
    for kernel in ("sdpa", "explicit"):
        model = build_model(dataclasses.replace(cfg, attention=kernel), dtype=torch.bfloat16)
        logits = model(tokens[:, :-1]).float()
        losses[kernel] = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(losses["sdpa"].item() - losses["explicit"].item()) < 2e-2


def test_an_unknown_attention_setting_is_refused_with_the_choices():
    with pytest.raises(PartitaError, match="'auto'.*'sdpa'.*'explicit'"):
        ModelConfig(attention="flash")
