"""The MoE block on one process: bad settings refused with what to change, the capacity
rule and the auxiliary losses independent of how the batch is cut, every expert's
weights drawn as in the stacked single-device tensor, parameter counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from partita.errors import PartitaError
from partita.layout import Layout, parse_layout
from partita.layout_rules import CONSTRAINT, DIVISIBILITY, find_problems
from partita.models.catalog import MODELS
from partita.models.model_config import ModelConfig
from partita.models.moe import MoE
from partita.models.transformer import build_model
from partita.planner.model_shape import PlanModel
from partita.planner.stage_params import stage_param_counts

TINY_MOE = MODELS["tiny-moe"]


@pytest.mark.parametrize("changes,message", [
    (dict(top_k=9), "between 1 and model.n_experts=8"),
    (dict(capacity_factor=0.0), "must be positive"),
    (dict(capacity_factor=-1.0), "must be positive"),
    (dict(router_gating="relu"), "router_gating"),
    (dict(moe_every=5), "exceeds model.n_layers"),
])
def test_bad_moe_settings_say_what_to_change(changes, message):
    with pytest.raises(PartitaError, match=message):
        dataclasses.replace(TINY_MOE, **changes)


@pytest.mark.parametrize("model,layout,kind,text", [
    (MODELS["tiny"], Layout(dp=4, ep=2), CONSTRAINT, "has no MoE blocks"),
    (dataclasses.replace(TINY_MOE, n_experts=6), Layout(dp=4, ep=4), DIVISIBILITY,
     "not divisible by parallel.ep=4"),
    (TINY_MOE, Layout(dp=4, tp=4, ep=4, moe_tp="experts"), DIVISIBILITY,
     "tp x ep = 16 ranks, but model.n_experts=8"),
    (dataclasses.replace(TINY_MOE, expert_ffn_dim=33), Layout(dp=2, tp=2, moe_tp="hidden"),
     DIVISIBILITY, "the expert width 33 is not divisible by tp=2"),
])
def test_moe_layout_rules(model, layout, kind, text):
    problems = find_problems(layout, model, layout.world_size, seq_len=32, global_batch=8)
    assert any(p.kind == kind and text in p.message for p in problems), problems
    for fine in (Layout(dp=4, ep=4), Layout(dp=2, tp=2, ep=2, sequence_parallel=True),
                 Layout(dp=2, cp=2, ep=4), Layout(dp=4, tp=2, ep=4, moe_tp="experts"),
                 Layout(dp=4, tp=4, ep=4, moe_tp="hidden")):
        assert not find_problems(fine, TINY_MOE, fine.world_size, seq_len=32, global_batch=8)


def test_moe_tp_is_checked_and_read_from_text():
    with pytest.raises(PartitaError, match="moe_tp='split' is unknown; choose one of "
                                           "replicate, experts, hidden"):
        Layout(tp=2, moe_tp="split")
    assert Layout(tp=4, moe_tp="hidden").expert_tp == 4
    assert Layout(tp=4, moe_tp="hidden").experts_over_tp == 1
    layout = parse_layout("dp=2 tp=2 ep=2 moe_tp=Experts")
    assert layout.moe_tp == "experts" and layout.expert_tp == 2
    assert parse_layout(layout.describe()) == layout
    assert Layout(tp=2).expert_tp == 1 and Layout(moe_tp="experts").expert_tp == 1


def test_planner_counts_experts_split_over_tp():
    """moe_tp="experts": a tp rank holds E/tp of each MoE block's experts and 1/tp of
    the shared experts' width; the router stays whole."""
    model = PlanModel("moe", dataclasses.replace(TINY_MOE, shared_experts=1))
    whole = model.block_split(2, moe=True)
    split = model.block_split(2, moe=True, experts_over_tp=True)
    shared = model.mlp_params(model.expert_ffn)
    assert split["expert"] == whole["expert"] / 2
    assert split["replicated"] == whole["replicated"] - shared
    assert split["sharded"] == whole["sharded"] + shared / 2
    counts = stage_param_counts(model, Layout(dp=2, tp=2, ep=2, moe_tp="experts"))
    assert counts["expert"] == stage_param_counts(model, Layout(dp=2, tp=2, ep=2))["expert"] / 2


def test_ep_must_divide_dp_times_cp():
    with pytest.raises(PartitaError, match="must divide dp\\*cp=4"):
        Layout(dp=4, ep=3)


def _moe(**changes) -> MoE:
    cfg = dataclasses.replace(TINY_MOE, dim=16, expert_ffn_dim=8, **changes)
    model = build_model(cfg, dtype=torch.float64)
    return model.blocks["1"].mlp


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_routing_and_losses_do_not_depend_on_the_batch_cut(gating):
    """Capacity, drops, gate weights and the per-sequence losses of 4 sequences routed
    together equal those of each sequence alone: any replica/microbatch split agrees."""
    moe = _moe(capacity_factor=1.0, router_gating=gating)
    x = torch.randn(4, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits = moe.router(x.reshape(-1, 16))
    whole, aux, z = moe.route(logits, 4, 12)
    assert whole.keep is not None and not whole.keep.all()  # capacity 3 of 24 choices
    for b in range(4):
        part, aux_b, z_b = moe.route(logits[b * 12:(b + 1) * 12], 1, 12)
        rows = slice(b * 12, (b + 1) * 12)
        assert torch.equal(part.experts, whole.experts[rows])
        assert torch.equal(part.keep, whole.keep[rows])
        assert torch.equal(part.weights, whole.weights[rows])
        assert torch.allclose(aux_b, aux[b:b + 1]) and torch.allclose(z_b, z[rows])
    # First choices outrank second ones: no expert keeps a second choice while dropping
    # a first one.
    for b in range(4):
        rows = slice(b * 12, (b + 1) * 12)
        for e in range(8):
            first_dropped = ((whole.experts[rows, 0] == e) & ~whole.keep[rows, 0]).any()
            second_kept = ((whole.experts[rows, 1] == e) & whole.keep[rows, 1]).any()
            assert not (first_dropped and second_kept)


def test_dropless_output_is_the_gated_sum_of_expert_outputs():
    moe = _moe(shared_experts=1)
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        route, _, _ = moe.route(moe.router(x.reshape(-1, 16)), 2, 5)
        out = moe(x).reshape(-1, 16)
        ex = moe.experts
        expected = moe.shared(x).reshape(-1, 16)
        for t, token in enumerate(x.reshape(-1, 16)):
            for j in range(2):
                e = int(route.experts[t, j])
                h = torch.nn.functional.silu(ex.w_gate[e] @ token) * (ex.w_up[e] @ token)
                expected[t] += route.weights[t, j] * (ex.w_down[e] @ h)
    assert torch.allclose(out, expected, rtol=1e-12, atol=1e-14)


def test_parameter_counts():
    model = build_model(TINY_MOE, device="meta")
    assert sum(p.numel() for p in model.parameters()) == TINY_MOE.num_params()
    assert [TINY_MOE.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    # Mixtral 8x7B: 46.7B parameters, 12.9B active per token (published figures).
    mixtral = MODELS["mixtral-8x7b"]
    assert mixtral.num_params() / 1e9 == pytest.approx(46.7, abs=0.05)
    active = mixtral.active_blocks_param_count() + 2 * mixtral.vocab_size * mixtral.dim
    assert active / 1e9 == pytest.approx(12.9, abs=0.05)
    assert isinstance(ModelConfig.from_dict(TINY_MOE.to_dict()), ModelConfig)


def test_auxiliary_losses_reach_the_router_gradient():
    """The aux and z losses join the gradient at the block's output, scaled like the
    loss: weighted 0 the router gradient changes, and it scales with aux_grad_scale."""
    x = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = []
    for weights, scale in (((0.1, 0.01), 1.0), ((0.0, 0.0), 1.0), ((0.1, 0.01), 3.0)):
        moe = _moe(aux_loss_weight=weights[0], z_loss_weight=weights[1])
        moe.aux_grad_scale = scale
        moe(x).sum().mul(scale).backward()
        grads.append(moe.router.weight.grad.clone())
    assert (grads[0] - grads[1]).abs().max() > 1e-6
    assert torch.allclose(grads[2], 3 * grads[0], rtol=1e-12)


def test_a_recomputed_moe_block_routes_identically_and_counts_once():
    """Full recompute runs the block without a graph, then reruns it in backward: twice
    when backward is split into an input pass and a weight pass (a pipeline's I and W).
    Output and gradients equal the plain block's (same routing and capacity drops), and
    the statistics the log reports count the forward once; evaluation counts nothing."""
    from partita.memory.recompute import recompute_module

    x = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    runs = []
    for recompute in (False, True):
        moe = _moe(capacity_factor=1.0, aux_loss_weight=0.1, z_loss_weight=0.01)
        if recompute:
            recompute_module(moe)
        with torch.no_grad():
            moe(x)
        assert moe.stats.tokens == 0
        xi = x.clone().requires_grad_()
        out = moe(xi)
        dout = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        (dx,) = torch.autograd.grad(out, [xi], dout, retain_graph=True)
        params = list(moe.parameters())
        dparams = torch.autograd.grad(out, params, dout)
        s = moe.stats
        runs.append([out.detach(), dx, *dparams, torch.tensor([s.aux, s.z, s.tokens,
                                                               s.dropped]), s.counts])
    assert runs[1][-2][2] == 12 and runs[1][-2][3] > 0  # every token once; some dropped
    for plain, recomputed in zip(*runs):
        assert torch.allclose(recomputed, plain, rtol=1e-12, atol=0), (recomputed, plain)
