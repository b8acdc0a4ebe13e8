"""Rotary tables (and the causal mask) as trace-time constants: the same values, and
never a stale constant.

Compiled code takes `rotary_constants`' result as a constant of the graph (see
partita.eager_only); the frequencies are plain floats that dynamo guards on, so a model
with other frequencies compiles again rather than reusing the first model's tables.
"""

from __future__ import annotations

import dataclasses

import torch

from partita.compile import compile_block_modules
from partita.models.model_config import ModelConfig
from partita.models.rotary import rope_frequencies, rotary_constants, rotary_tables
from partita.models.transformer import build_model

SMALL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1,
                    max_seq_len=64)
LLAMA3 = dataclasses.replace(SMALL, rope_theta=500000.0, rope_scaling="llama3",
                             rope_factor=8.0, rope_original_max_len=16)


def test_constants_are_bitwise_the_traced_tables():
    for cfg in (SMALL, LLAMA3):
        inv_freq = rope_frequencies(cfg)
        for dtype in (torch.float32, torch.float64):
            want = rotary_tables(16, cfg.head_dim, cfg.rope_theta, "cpu", dtype, 5, inv_freq)
            got = rotary_constants(16, 5, tuple(inv_freq.tolist()), torch.device("cpu"),
                                   dtype)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == dtype and torch.equal(g, w)


def test_compiled_blocks_of_two_rope_settings_each_match_eager():
    """Same shapes and weights, other frequencies: the second model must not read the
    first one's tables."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, SMALL.dim, dtype=torch.float64)
    eager_outputs = []
    for cfg in (SMALL, LLAMA3):
        block = build_model(cfg, dtype=torch.float64).blocks["0"]
        with torch.no_grad():
            want = block(x)
            compile_block_modules([block])
            got = block(x)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        eager_outputs.append(want)
    # The check can fail: the two settings' outputs differ by far more than its tolerance
    # (about 7e-5 here, at initialisation, against 1e-10).
    assert (eager_outputs[0] - eager_outputs[1]).abs().max() > 1e-6


def test_a_whole_compiled_model_with_explicit_scores_matches_eager():
    """Every layer's explicit attention takes the causal mask as one trace-time constant
    (`causal_bias`); returned bare, its second call in one graph failed in dynamo
    ("already in seen_sources"). The whole model compiled, float64, forward + backward."""
    from partita.compile import compile_model

    cfg = dataclasses.replace(SMALL, attention="explicit")
    torch.manual_seed(0)
    eager = build_model(cfg, dtype=torch.float64)
    compiled = build_model(cfg, dtype=torch.float64)
    compiled.load_state_dict(eager.state_dict())
    compile_model(compiled)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    losses = []
    for model in (eager, compiled):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
