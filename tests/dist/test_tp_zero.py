"""DP x TP (2D): tensor parallelism inside, ZeRO over the data-parallel group, against
one process with the same global batch. Float64: losses, clipped gradient norms and
final parameters within 1e-10 over 10 steps. The gradient norm covers tp-split shards
once each and tp-replicated parameters (norms, replicated kv projections) once, not
once per tp rank: double counting would show as a norm mismatch (checked both ways).
"""

from __future__ import annotations

import math

from partita.testing import Case, check_layouts, parity_config, reference, relative_error

STEPS = 10
LLAMA = dict(vocab_size=67)
CASES = [
    Case("zero1", parity_config(model=LLAMA, parallel=dict(dp=2, tp=2, zero_stage=1,
                                                           bucket_mb=0.02),
                                train=dict(global_batch=4, lr=1e-2)), params=True),
    # SP norms, replicated kv projections (1 kv head at tp=2) and the tied head: every
    # kind of tp-replicated gradient the norm must count once.
    Case("zero3-sp-gpt2-tied-mqa",
         parity_config(model={**LLAMA, "flavour": "gpt2", "tie_embeddings": True,
                              "n_kv_heads": 1},
                       parallel=dict(dp=2, tp=2, zero_stage=3, bucket_mb=0.02,
                                     sequence_parallel=True),
                       train=dict(global_batch=4, lr=1e-2)), params=True),
]


def _doubled_norms(cfg) -> list[float]:
    """What a norm counting every tp copy of a replicated parameter (the norm weights)
    twice would report on the reference's gradients."""
    grads = reference(cfg, STEPS, grads_at=range(STEPS))["grads"]
    out = []
    for step in range(STEPS):
        mine = {name: g for (s, name), (_, g) in grads.items() if s == step}
        twice = sum(g.pow(2).sum().item() for n, g in mine.items()
                    if "norm" in n.rsplit(".", 1)[0])
        out.append(math.sqrt(sum(g.pow(2).sum().item() for g in mine.values()) + twice))
    return out


def test_dp2_tp2_zero_matches_single_process() -> None:
    results = check_layouts(CASES, 4, STEPS, timeout=150)
    for case, (ranks, _) in zip(CASES, results):
        doubled = _doubled_norms(case.cfg)
        for rank, got in enumerate(ranks):
            # The test can tell: double counting the replicated norms moves the norm.
            assert relative_error(got["norms"], doubled) > 1e-6, (case.id, rank)
