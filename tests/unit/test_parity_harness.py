"""The parity harness itself: its error definition, that assert_parity fails when it
must, and that its single-process reference (partita's own build at world size 1) is
plain PyTorch training: the same model, torch.optim.AdamW, clip_grad_norm_."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from partita.models.transformer import build_model
from partita.testing import (
    FLOAT64_TOL,
    PARITY_FLOOR,
    assert_parity,
    compare_to_reference,
    parity_config,
    reference,
    relative_error,
    single_process,
    token_batch,
)


def test_relative_error_of_a_tensor_is_measured_on_its_largest_entry():
    b = torch.tensor([4.0, 1e-3], dtype=torch.float64)
    a = b + torch.tensor([0.0, 1e-9], dtype=torch.float64)
    assert relative_error(a, b) == pytest.approx(1e-9 / 4.0)
    assert relative_error(a.numpy(), b) == pytest.approx(2.5e-10)  # arrays too


def test_a_series_is_measured_step_by_step():
    # The small step's own scale counts: 1e-9 on 1e-2 is 1e-7, not 1e-9 / 4.
    assert relative_error([4.0, 1e-2 + 1e-9], [4.0, 1e-2]) == pytest.approx(1e-7)
    with pytest.raises(AssertionError, match="series lengths differ"):
        relative_error([1.0], [1.0, 2.0])


def test_the_floor_covers_quantities_that_are_zero_in_exact_arithmetic():
    noise = torch.tensor([3e-19, -1e-19], dtype=torch.float64)
    assert relative_error(noise, -noise) == pytest.approx(6e-19 / PARITY_FLOOR)
    assert relative_error(noise, -noise) < FLOAT64_TOL
    assert relative_error(0.0, 0.0) == 0.0


def test_shapes_and_nan_fail():
    with pytest.raises(AssertionError, match="shapes differ"):
        relative_error(torch.zeros(2, 3), torch.zeros(3, 2))
    assert math.isnan(relative_error(torch.tensor([math.nan]), torch.tensor([1.0])))


def test_assert_parity_names_what_differs_and_what_is_missing():
    expected = {"loss": [4.0, 3.5], "w": torch.ones(3, dtype=torch.float64)}
    assert_parity({"loss": [4.0, 3.5], "w": torch.ones(3, dtype=torch.float64)}, expected,
                  FLOAT64_TOL, "same")
    with pytest.raises(AssertionError, match=r"case: 1 of 2 quantities .*\n  loss: 2\.86e-09"):
        assert_parity({"loss": [4.0, 3.5 + 1e-8], "w": torch.ones(3)}, expected,
                      FLOAT64_TOL, "case")
    with pytest.raises(AssertionError, match=r"missing \['w'\], unexpected \['v'\]"):
        assert_parity({"loss": [4.0, 3.5], "v": 1.0}, expected, FLOAT64_TOL, "case")
    with pytest.raises(AssertionError, match="nan"):
        assert_parity({"loss": [math.nan, 3.5], "w": torch.ones(3)}, expected, 1.0, "nan")


def test_single_process_drops_the_layout_and_keeps_the_rest():
    cfg = parity_config(parallel=dict(tp=2, pp=2, zero_stage=1, sequence_parallel=True),
                        train=dict(microbatches=4, lr=1e-2), model=dict(n_layers=4))
    ref = single_process(cfg)
    assert (ref.parallel.tp, ref.parallel.pp, ref.parallel.zero_stage) == (1, 1, 0)
    assert not ref.parallel.sequence_parallel and ref.train.microbatches == 1
    assert ref.train.lr == 1e-2 and ref.model_config() == cfg.model_config()
    assert cfg.parallel.tp == 2 and cfg.train.microbatches == 4  # the original is kept


def _plain_pytorch(cfg, steps: int) -> dict:
    """What the reference must equal: build_model, torch.optim.AdamW (no decay on
    vectors), torch.nn.utils.clip_grad_norm_, the same batches."""
    model = build_model(cfg.model_config(), dtype=torch.float64)
    params = dict(model.named_parameters())
    t = cfg.train
    opt = torch.optim.AdamW(
        [{"params": [p for p in params.values() if p.ndim >= 2]},
         {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}],
        lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)

    def loss_of(step: int) -> torch.Tensor:
        tokens = token_batch(step, t.global_batch, cfg.data.seq_len,
                             cfg.model_config().vocab_size)
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    out = {"losses": [], "norms": [], "grads": {}}
    for step in range(steps):
        loss = loss_of(step)
        loss.backward()
        if step == 0:
            out["grads"] = {(0, n): (None, p.grad.clone()) for n, p in params.items()}
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    with torch.no_grad():
        out["val"] = loss_of(steps).item()
    out["params"] = {n: (None, p.detach().clone()) for n, p in params.items()}
    return out


@pytest.mark.parametrize("model", [
    {},
    {"flavour": "gpt2", "tie_embeddings": True, "n_kv_heads": None, "vocab_size": 67},
])
def test_the_reference_is_plain_pytorch_training(model):
    cfg = parity_config(model=model, train=dict(lr=1e-2))
    ref = reference(cfg, steps=6, grads_at=(0,), params=True)
    plain = _plain_pytorch(cfg, steps=6)
    # The reference's own record compared as a rank's would be, every weight included.
    actual, expected = compare_to_reference(ref, plain)
    assert any(k.startswith("grad ") for k in actual) and any(k.startswith("param ")
                                                              for k in actual)
    assert_parity(actual, expected, FLOAT64_TOL, f"reference vs PyTorch {model}")
    # And it can tell: one more step of training is far outside the tolerance.
    longer = _plain_pytorch(cfg, steps=7)
    with pytest.raises(AssertionError, match="param"):
        assert_parity({k: v for k, v in actual.items() if k.startswith("param")},
                      {f"param {n}": v for n, (_, v) in longer["params"].items()},
                      FLOAT64_TOL, "one step apart")
