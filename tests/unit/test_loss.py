"""partita.loss.cross_entropy against torch's, on the whole vocabulary (the sharded form
is checked against it across ranks in tests/dist/test_tp_distributed.py)."""

import pytest
import torch
import torch.nn.functional as F

import partita.loss
from partita.loss import cross_entropy


@pytest.fixture(params=["ours", "fused"], autouse=True)
def path(request, monkeypatch):
    """Every test runs twice: with our kernel forced, and as dispatched by default
    (torch's fused kernel at these sizes, unless the call needs ours: padding)."""
    if request.param == "ours":
        monkeypatch.setattr(partita.loss, "FUSED_UP_TO", 0)
    else:
        assert _case(torch.float32)[0].numel() <= partita.loss.FUSED_UP_TO
    return request.param


def _case(dtype: torch.dtype, tokens: int = 96, vocab: int = 211):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, tokens // 2, vocab, generator=gen, dtype=torch.float64) * 4)
    targets = torch.randint(0, vocab, (2, tokens // 2), generator=gen)
    targets[0, ::5] = -100  # not counted
    return logits.to(dtype), targets


def _loss_and_grad(fn, logits: torch.Tensor, targets: torch.Tensor):
    x = logits.clone().requires_grad_()
    loss = fn(x, targets)
    loss.backward()
    return loss.detach(), x.grad


def _torch(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    return F.cross_entropy(wide.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5),
                                       (torch.bfloat16, 1e-2)])
def test_equals_torch_cross_entropy(dtype, tol):
    logits, targets = _case(dtype)
    loss, grad = _loss_and_grad(cross_entropy, logits, targets)
    want_loss, want_grad = _loss_and_grad(_torch, logits, targets)
    # The loss is computed in at least fp32, as torch's is on upcast 16-bit logits.
    assert loss.dtype == torch.promote_types(dtype, torch.float32)
    assert torch.allclose(loss, want_loss, rtol=tol, atol=0)
    assert grad.dtype == dtype
    err = (grad.double() - want_grad.double()).abs().max() / want_grad.double().abs().max()
    assert err <= tol
    assert grad[0, ::5].abs().max() == 0  # ignored tokens get no gradient


def test_fp32_logits_are_left_as_they_were():
    """Only a copy of its own is worked on in place: fp32 logits may be read again."""
    logits, targets = _case(torch.float32)
    before = logits.clone()
    cross_entropy(logits.requires_grad_(), targets).backward()
    assert torch.equal(logits.detach(), before)


def test_padding_columns_carry_no_probability():
    logits, targets = _case(torch.float64)
    padded = torch.cat([logits, torch.full_like(logits[..., :5], 50.0)], dim=-1)
    got = cross_entropy(padded, targets, vocab_size=logits.shape[-1])
    assert torch.allclose(got, _torch(logits, targets), rtol=1e-12, atol=0)


def test_no_counted_token_gives_zero_loss_and_gradient():
    logits, targets = _case(torch.float64)
    targets.fill_(-100)
    loss, grad = _loss_and_grad(cross_entropy, logits, targets)
    assert loss.item() == 0.0 and grad.abs().max() == 0


def test_small_inputs_take_torchs_kernel_and_large_ones_ours(path):
    """The dispatch itself: which autograd node the loss hangs from (with the bound
    forced to 0, everything takes ours)."""
    logits, targets = _case(torch.float32)
    small = cross_entropy(logits.requires_grad_(), targets).grad_fn
    big = torch.zeros(max(partita.loss.FUSED_UP_TO, 64) // 64 + 1, 64, requires_grad=True)
    large = cross_entropy(big, torch.zeros(big.shape[0], dtype=torch.long)).grad_fn
    assert ("_CrossEntropy" in type(small).__name__) == (path == "ours")
    assert "_CrossEntropy" in type(large).__name__
