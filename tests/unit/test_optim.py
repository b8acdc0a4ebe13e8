"""partita.optim without processes: the LR schedule, AdamW on a flat slice against
torch.optim.AdamW, the global gradient norm and clip factor, and the ZeRO stage policy."""

from __future__ import annotations

import math

import pytest
import torch

from partita.errors import PartitaError
from partita.optim import (
    AdamWConfig,
    AdamWState,
    WarmupCosine,
    adamw_,
    adamw_scratch,
    clip_coefficient,
    global_norm,
    squared_sum,
)
from partita.zero import ZeroConfig, ZeroStage


# Learning-rate schedule -----------------------------------------------------------------
def test_warmup_rises_linearly_to_the_peak() -> None:
    s = WarmupCosine(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=12)
    assert [s(k) for k in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=1e-15)


def test_cosine_decay_reaches_the_floor_at_the_last_step_and_stays() -> None:
    s = WarmupCosine(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=12)
    assert s(4) == pytest.approx(1.0, abs=1e-15)  # decay starts from the peak
    # progress 1/4: 0.1 + 0.45 (1 + cos(pi/4)); half way: the mean of peak and floor
    assert s(6) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)), abs=1e-15)
    assert s(8) == pytest.approx(0.55, abs=1e-15)
    assert s(12) == pytest.approx(0.1, abs=1e-15)
    assert s(40) == pytest.approx(0.1, abs=1e-15)
    decay = [s(k) for k in range(4, 13)]
    assert all(a > b for a, b in zip(decay, decay[1:]))


def test_no_warmup_starts_at_the_peak() -> None:
    s = WarmupCosine(lr=3e-3, min_lr=3e-4, warmup_steps=0, total_steps=10)
    assert s(0) == 3e-3
    assert s(10) == pytest.approx(3e-4, abs=1e-18)


def test_negative_warmup_is_refused() -> None:
    with pytest.raises(PartitaError, match="warmup_steps"):
        WarmupCosine(lr=1.0, min_lr=0.0, warmup_steps=-1, total_steps=10)


# AdamW on a flat slice ------------------------------------------------------------------
SHAPES = [(5, 7), (7,), (3, 4), (1,)]  # matrices decay, vectors do not
CFG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LRS = [1e-2, 5e-3, 2e-2, 1e-3, 7e-3]


def _layout() -> tuple[int, list[tuple[int, int]]]:
    offset, decay = 0, []
    for shape in SHAPES:
        n = math.prod(shape)
        if len(shape) >= 2:
            decay.append((offset, offset + n))
        offset += n
    return offset, decay


def _torch_reference(init: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """torch.optim.AdamW on the separate parameters, decay on the matrices only."""
    params, offset = [], 0
    for shape in SHAPES:
        n = math.prod(shape)
        params.append(torch.nn.Parameter(init[offset:offset + n].clone().view(shape)))
        offset += n
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": CFG.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, foreach=False)
    for lr, g in zip(LRS, grads):
        offset = 0
        for p in params:
            p.grad = g[offset:offset + p.numel()].view(p.shape).to(p.dtype)
            offset += p.numel()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_adamw_on_a_flat_slice_is_torch_adamw_in_float64() -> None:
    numel, decay = _layout()
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(numel, generator=gen, dtype=torch.float64)
    grads = [torch.randn(numel, generator=gen, dtype=torch.float64) for _ in LRS]
    flat, m, v = init.clone(), torch.zeros(numel, dtype=torch.float64), \
        torch.zeros(numel, dtype=torch.float64)
    scratch = adamw_scratch(0, torch.float64, torch.device("cpu"))
    for step, (lr, g) in enumerate(zip(LRS, grads), start=1):
        adamw_(flat, g, m, v, step, lr, CFG, decay, scratch)
    ref = _torch_reference(init, grads)
    assert _max_rel(flat, ref) < 1e-12
    assert _max_rel(flat, init) > 1e-3  # the update did something


def test_adamw_state_with_a_master_copy_and_chunked_casts() -> None:
    """float32 parameters, float64 master and moments, float32 gradients cast through a
    scratch smaller than the slice: the master follows torch.optim.AdamW in float64 on
    the same gradients, and the parameters are the master rounded."""
    numel, decay = _layout()
    gen = torch.Generator().manual_seed(1)
    init = torch.randn(numel, generator=gen, dtype=torch.float64).float()
    grads = [torch.randn(numel, generator=gen) for _ in LRS]
    param = init.clone()
    state = AdamWState.for_slice(param, torch.float64, decay)
    assert state.master is not None and state.exp_avg.dtype == torch.float64
    scratch = torch.empty(7, dtype=torch.float64)  # 62 elements in 9 chunks
    for step, (lr, g) in enumerate(zip(LRS, grads), start=1):
        state.step_(param, g, step, lr, CFG, scratch)
    ref = _torch_reference(init.double(), [g.double() for g in grads])
    assert _max_rel(state.master, ref) < 1e-12
    assert torch.equal(param, state.master.float())


def test_adamw_state_without_master_updates_the_slice_in_place() -> None:
    numel, decay = _layout()
    param = torch.ones(numel, dtype=torch.float64)
    state = AdamWState.for_slice(param, torch.float64, decay)
    assert state.master is None
    state.step_(param, torch.ones(numel, dtype=torch.float64), 1, 1e-2, CFG,
                adamw_scratch(0, torch.float64, torch.device("cpu")))
    # Step 1 moves every element by lr (m/sqrt(v) = 1), the decayed ones by lr * wd more.
    decayed = torch.zeros(numel, dtype=torch.bool)
    for a, b in decay:
        decayed[a:b] = True
    assert torch.allclose(param[~decayed], torch.full_like(param[~decayed], 0.99), atol=1e-9)
    assert torch.allclose(param[decayed], torch.full_like(param[decayed], 0.999 - 0.01),
                          atol=1e-9)
    param.fill_(0.5)
    state.load_param_(param)  # nothing to follow without a master: no error


# Gradient norm and clipping -------------------------------------------------------------
class _Group:
    """A group whose other members contributed `others` to a sum."""

    def __init__(self, others: float) -> None:
        self.others = others

    def all_reduce_scalars(self, values: list[float]) -> list[float]:
        return [values[0] + self.others]


def test_clip_coefficient_is_torchs() -> None:
    assert clip_coefficient(10.0, 1.0) == 1.0 / (10.0 + 1e-6)
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(1e9, None) == 1.0


def test_norm_of_a_gradient_split_over_two_groups_matches_torch_clipping() -> None:
    """A gradient cut in four pieces held by 2 x 2 ranks: each rank's squared sum added
    over both groups gives torch's norm of the whole, and the clip factor torch's."""
    gen = torch.Generator().manual_seed(2)
    full = torch.randn(101, generator=gen, dtype=torch.float64) * 3
    pieces = [full[:20], full[20:55], full[55:90], full[90:]]
    sums = [squared_sum([p], torch.device("cpu")) for p in pieces]
    # Rank 0 holds piece 0; its zero-shard partner piece 1; the model-parallel partners
    # hold pieces 2 and 3 (their own shard group having already summed them).
    norm = global_norm(sums[0], [_Group(sums[1]), _Group(sums[2] + sums[3])])
    ref = full.clone().requires_grad_()
    ref.grad = full.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_([ref], 1.0).item()
    assert norm == pytest.approx(torch_norm, rel=1e-14)
    clipped = full * clip_coefficient(norm, 1.0)
    assert _max_rel(clipped, ref.grad) < 1e-14
    assert clipped.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_squared_sum_accumulates_low_precision_in_float64() -> None:
    g = torch.full((4096,), 300.0, dtype=torch.bfloat16)  # 4096 * 9e4: beyond bf16's 8 bits
    assert squared_sum([g, g[:10]], torch.device("cpu")) == 4106 * 90000.0


# The ZeRO stage policy ------------------------------------------------------------------
@pytest.mark.parametrize("number, states, grads, params, all_reduce, gather_after", [
    (0, False, False, False, True, False),
    (1, True, False, False, False, True),
    (2, True, True, False, False, True),
    (3, True, True, True, False, False),
])
def test_zero_stage_properties(number, states, grads, params, all_reduce,
                               gather_after) -> None:
    s = ZeroStage(number)
    assert (s.shards_optimizer_states, s.shards_gradients, s.shards_parameters) == \
        (states, grads, params)
    assert s.all_reduces_gradients == all_reduce
    assert s.gathers_parameters_after_step == gather_after
    assert s.can_buffer_accumulation == (number == 2)
    assert int(s) == number and ZeroStage.of(s) is s and ZeroStage.of(number) == s


@pytest.mark.parametrize("bad", [-1, 4, "2", None, True])
def test_zero_stage_refuses_other_values(bad) -> None:
    with pytest.raises(PartitaError, match="zero_stage"):
        ZeroStage(bad)
    with pytest.raises(PartitaError, match="zero_stage"):
        ZeroConfig(stage=bad)


@pytest.mark.parametrize("stage, accumulation, full_buffer", [
    (0, "reduce", True), (1, "reduce", True), (1, "buffer", True),
    (2, "reduce", False), (2, "buffer", True), (3, "reduce", False), (3, "buffer", False),
])
def test_zero_config_keeps_the_stage_as_a_policy(stage, accumulation, full_buffer) -> None:
    cfg = ZeroConfig(stage=stage, accumulation=accumulation)
    assert cfg.stage == ZeroStage(stage)
    assert cfg.accumulates_in_full_buffer == full_buffer


def test_squared_sum_is_close_to_the_float64_sum_in_rows_and_chunks() -> None:
    """float32 rows with their squares added in float64; bf16 cast to float64 in chunks
    (more elements than one chunk here): both close to the exact sum."""
    gen = torch.Generator().manual_seed(3)
    g = torch.rand(300_001, generator=gen)
    exact = float((g.double() ** 2).sum())
    assert squared_sum([g[:5], g[5:]], torch.device("cpu")) == pytest.approx(exact, rel=1e-6)
    b = g.bfloat16()
    assert squared_sum([b], torch.device("cpu")) == \
        pytest.approx(float((b.double() ** 2).sum()), rel=1e-12)
