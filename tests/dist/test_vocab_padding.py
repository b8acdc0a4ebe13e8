"""A padded vocabulary (model.vocab_multiple) trains exactly like the unpadded model.

A 250-token model stored with 256 rows (vocab_multiple=64) against the same model with
250 rows, whose initial rows are the padded model's first 250 (both draw each row from
its flat position, tests/unit/test_vocab_padding.py checks it): float64 AdamW steps
through partita's engine at one process, tp=2 and ZeRO-3 over dp=2, untied and tied.
Losses, gradient norms and the validation loss within 1e-10 relative, and after the
steps every parameter, the embedding and head cut to their 250 real rows, too. A loss
that gave the padding columns any probability moves every one of them.
"""

from __future__ import annotations

import pytest
import torch

from partita.testing import (
    FLOAT64_TOL,
    Case,
    assert_parity,
    parity_config,
    reference,
    run_layouts,
)

VOCAB, MULTIPLE, ROWS = 250, 64, 256
STEPS = 4
VOCAB_PARAMS = ("tok_embeddings.weight", "output.weight")
LLAMA = dict(vocab_size=VOCAB, n_kv_heads=None, seed=5)
GPT2_TIED = dict(LLAMA, flavour="gpt2", tie_embeddings=True)
MODELS = {"llama": LLAMA, "gpt2-tied": GPT2_TIED}


def config(model: dict, multiple: int, **parallel):
    return parity_config(model=dict(model, vocab_multiple=multiple),
                         train=dict(global_batch=4, lr=1e-2), parallel=parallel)


def assemble(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Every parameter's global tensor from the ranks' shards."""
    full: dict[str, torch.Tensor] = {}
    for got in ranks:
        for name, (info, value) in got["params"].items():
            whole = full.setdefault(name, value.new_full(info.global_shape, float("nan")))
            for dim, start, stop in info.cuts:
                whole = whole.narrow(dim, start, stop - start)
            whole.copy_(value)
    return full


def compare(padded: dict, params: dict[str, torch.Tensor], unpadded: dict, what: str) -> None:
    """The padded run's figures and real rows against the unpadded run's."""
    ref = {name: value for name, (_, value) in unpadded["params"].items()}
    assert {n: tuple(p.shape) for n, p in params.items() if n in VOCAB_PARAMS} == {
        n: (ROWS, p.shape[1]) for n, p in ref.items() if n in VOCAB_PARAMS}
    actual = {"loss": padded["losses"], "grad norm": padded["norms"], "val": padded["val"]}
    expected = {"loss": unpadded["losses"], "grad norm": unpadded["norms"],
                "val": unpadded["val"]}
    for name, value in params.items():
        actual[f"param {name}"] = value[:VOCAB] if name in VOCAB_PARAMS else value
        expected[f"param {name}"] = ref[name]
    assert_parity(actual, expected, FLOAT64_TOL, what)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_one_process(model: str) -> None:
    unpadded = reference(config(MODELS[model], 1), STEPS, params=True)
    padded = reference(config(MODELS[model], MULTIPLE), STEPS, params=True)
    assert unpadded["losses"][-1] < unpadded["losses"][0]  # it trains
    compare(padded, assemble([padded]), unpadded, f"{model} padded, one process")


def test_tensor_parallel_and_zero3() -> None:
    cases = [Case(f"{kind}-{model}", config(MODELS[model], MULTIPLE, **parallel), params=True)
             for kind, parallel in (("tp2", dict(tp=2)), ("zero3", dict(dp=2, zero_stage=3)))
             for model in sorted(MODELS)]
    runs = run_layouts(cases, world=2, steps=STEPS, timeout=200)
    for case, ranks in zip(cases, runs):
        model = case.id.split("-", 1)[1]
        unpadded = reference(config(MODELS[model], 1), STEPS, params=True)
        params = assemble(ranks)
        for rank, got in enumerate(ranks):
            compare(got, params, unpadded, f"{case.id} rank {rank}")
