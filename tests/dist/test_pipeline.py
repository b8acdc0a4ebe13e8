"""Pipeline runtime pieces without a world: the stage split, the split backward, the
transfer order, bad settings (`test_pipeline_steps.py` has the two-rank steps)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from partita.errors import PartitaError
from partita.models.model_config import ModelConfig
from partita.models.transformer import Transformer, build_model
from partita.parallelize import check_layout
from partita.pipeline import build_schedule, schedule_names
from partita.pipeline.actions import Action, Kind
from partita.pipeline.backward import (
    ForwardSaves,
    _adds_in_place,
    _direct_weight_grad,
    backward_input,
    full_backward,
)
from partita.pipeline.build import pipeline_schedule
from partita.pipeline.p2p import check_transfer_order, delivery_proofs
from partita.pipeline.schedules import forward_only
from partita.pipeline.stage import detach_tied_copy, keep_stages, plan_stages
from partita.saved_tensors import SavedTensorMeter
from tests.dist.pipeline_cases import pipeline_config

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=8, n_heads=4, max_seq_len=16)


def _meta(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


def _names(model: nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_each_rank_keeps_its_stages_under_global_names(tied):
    cfg = ModelConfig(**{**CFG.to_dict(), "tie_embeddings": tied})
    layout = plan_stages(cfg, pp=2, virtual=2)
    assert [list(r) for r in layout.blocks] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    full = _names(_meta(cfg))
    kept = []
    for rank in range(2):
        model = _meta(cfg)
        keep_stages(model, model.plan(), layout, rank)
        detach_tied_copy(model, model.plan(), layout, rank)
        kept.append(_names(model))
    blocks = [{n.split(".")[1] for n in names if n.startswith("blocks.")} for names in kept]
    assert blocks == [{"0", "1", "4", "5"}, {"2", "3", "6", "7"}]
    assert "tok_embeddings.weight" in kept[0] and "norm.weight" in kept[1]
    assert kept[0] | kept[1] == full and not kept[0] & kept[1]  # tied copy: no parameter
    if tied:
        model = _meta(cfg)
        keep_stages(model, model.plan(), layout, 1)
        assert model.tok_embeddings is not None  # the head needs the matrix


def test_balanced_split_counts_embedding_and_head():
    cfg = ModelConfig(vocab_size=8192, dim=64, n_layers=12, n_heads=4, max_seq_len=16)
    even = plan_stages(cfg, pp=4, virtual=1)
    assert [len(r) for r in even.blocks] == [3, 3, 3, 3]
    for mode in ("params", "flops"):
        sizes = [len(r) for r in plan_stages(cfg, 4, 1, balance=mode).blocks]
        assert sum(sizes) == 12 and sizes[-1] < 3, (mode, sizes)
    with pytest.raises(PartitaError, match="balance"):
        plan_stages(cfg, 4, 1, balance="bogus")


class _Shared(nn.Module):
    """A weight used twice: W must not count it twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) + torch.nn.functional.linear(h * h, self.a.weight)


@pytest.mark.parametrize("release", [False, True, "under-meter"])
@pytest.mark.parametrize("which", ["transformer", "llama", "shared-weight"])
def test_split_backward_equals_full_backward_and_fires_hooks_once(which, release):
    """I then W gives one full backward's gradients bit for bit, each parameter's hook
    firing once. With the forward inside ForwardSaves, I releases what W cannot read
    (W still matches), also beneath an outer saved-tensor hook (the meter), which then
    sees the memory go."""
    torch.manual_seed(0)
    if which in ("transformer", "llama"):
        flavour = "gpt2" if which == "transformer" else "llama"
        model = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4,
                                        max_seq_len=16, flavour=flavour), dtype=torch.float64)
        x = torch.randn(2, 16, 32, dtype=torch.float64)

        def run(inp):
            for block in model.blocks.values():
                inp = block(inp)
            return model.logits(model.norm(inp))
    else:
        model = _Shared().double()
        x = torch.randn(4, 8, dtype=torch.float64)
        run = model
    params = list(model.parameters())
    x1 = x.clone().requires_grad_()
    out = run(x1)
    grad = torch.randn_like(out)
    full_backward([out], [grad])
    params = [p for p in params if p.grad is not None]  # the blocks and the head
    want = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)

    fired = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p))) for p in params]
    x2 = x.clone().requires_grad_()
    meter = SavedTensorMeter(model)
    saves = ForwardSaves() if release else None
    with meter if release == "under-meter" else contextlib.nullcontext():
        with saves or contextlib.nullcontext():
            out = run(x2)
    saved_before = meter.live_bytes
    (x_grad,), weights = backward_input([out], [grad], [x2], params, saves)
    del out
    if release == "under-meter":  # the meter saw what I released go
        assert 0 < meter.live_bytes < 0.8 * saved_before, (meter.live_bytes, saved_before)
    assert not fired and all(p.grad is None for p in params)  # I touched no weight
    if which == "llama":  # linear weights and norm scales: W re-enters autograd nowhere
        assert weights.groups and all(_direct_weight_grad(*group) is not None
                                      for group in weights.groups)
    torch.testing.assert_close(x_grad, x1.grad, rtol=0, atol=1e-14)
    weights.run()
    for p, g in zip(params, want):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-14)
    assert sorted(fired) == sorted(id(p) for p in params)  # each accumulated once
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("hooked", [False, True])
def test_w_accumulates_into_existing_grads_in_place_unless_a_hook_watches(hooked):
    """With .grad already holding a sum (a later microbatch, or the data-parallel
    engine's bucket views), W adds the linear and norm weight gradients into those very
    tensors; a parameter with a hook goes through autograd, which fires it once."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4,
                                    max_seq_len=16), dtype=torch.float64)

    def run(inp):
        for block in model.blocks.values():
            inp = block(inp)
        return model.logits(model.norm(inp))

    x = torch.randn(2, 16, 32, dtype=torch.float64)
    x1 = x.clone().requires_grad_()
    out = run(x1)
    grad = torch.randn_like(out)
    full_backward([out], [grad])
    params = [p for p in model.parameters() if p.grad is not None]
    want = {id(p): p.grad.clone() for p in params}
    held = {id(p): torch.randn_like(p) for p in params}  # what .grad holds before
    for p in params:
        p.grad = held[id(p)].clone()
    tensors = {id(p): p.grad for p in params}
    fired = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
             for p in params] if hooked else []
    assert all(_adds_in_place(p) for p in params) is not hooked  # the path W takes
    x2 = x.clone().requires_grad_()
    (_,), weights = backward_input([run(x2)], [grad], [x2], params)
    weights.run()
    for p in params:
        assert p.grad is tensors[id(p)]  # accumulated in place, both ways
        torch.testing.assert_close(p.grad, held[id(p)] + want[id(p)], rtol=0, atol=1e-13)
    if hooked:
        assert sorted(fired) == sorted(id(p) for p in params)
    for h in hooks:
        h.remove()


def test_nothing_saved_through_forward_saves_outlives_w():
    """Once W has run, every tensor the forward saved is freed: none is kept alive by
    a cycle between a saved output and its own node (which `gc` cannot break)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4,
                                    max_seq_len=16))
    x = torch.randn(2, 16, 32, requires_grad=True)
    saves = ForwardSaves()
    with saves:
        out = x
        for block in model.blocks.values():
            out = block(out)
    saved = [weakref.ref(s.value) for s in saves.slots]
    (_,), weights = backward_input([out], [torch.ones_like(out)], [x],
                                   list(model.parameters()), saves)
    weights.run()
    del out, weights, saves
    gc.collect()
    assert saved and sum(r() is not None for r in saved) == 0


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6)])
def test_transfers_match_in_order_and_forward_only_is_valid(name, p, m):
    sched = build_schedule(name, p, m)
    check_transfer_order(sched)
    forward_only(sched)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6)])
def test_a_send_is_proven_delivered_only_by_a_receive_the_peer_sends_after_taking_it(
        name, p, m):
    """Each proof is a receive of the same rank, later in its list than the send, whose
    matching send the peer posts after its own receive of ours; in 1F1B every
    activation the first stage sends is proven (so none waits for the step's end)."""
    sched = build_schedule(name, p, m)
    for checked in (sched, forward_only(sched)):  # training, and evaluation's
        for rank, acts in enumerate(checked.ranks):
            where = {a: i for i, a in enumerate(acts)}
            for send, proof in delivery_proofs(checked, rank).items():
                assert proof.kind.is_recv and where[proof] > where[send], (rank, send)
                peer = checked.ranks[checked.rank_of(send.peer_stage)]
                took = next(i for i, a in enumerate(peer)
                            if a.kind.is_recv and a.transfer_key == send.transfer_key)
                answered = next(i for i, a in enumerate(peer)
                                if a.kind.is_send and a.transfer_key == proof.transfer_key)
                assert answered > took, (rank, send, proof)
    if name == "1f1b":
        sends = [a for a in sched.ranks[0] if a.kind.is_send]
        assert sends and set(sends) <= set(delivery_proofs(sched, 0))


def test_transfer_order_mismatch_is_rejected():
    sched = build_schedule("1f1b", 2, 4)
    acts = list(sched.ranks[1])
    i, j = acts.index(Action(Kind.RECV_F, 0, 1)), acts.index(Action(Kind.RECV_F, 0, 2))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(PartitaError, match="another order"):
        check_transfer_order(sched.replace_rank(1, acts))


def _check(cfg) -> None:
    """What the launcher and every worker run before any process waits on another."""
    layout = cfg.layout(cfg.parallel.dp * cfg.parallel.pp * cfg.parallel.tp)
    check_layout(cfg, cfg.model_config(), layout)
    sched = pipeline_schedule(layout, cfg.train.microbatches)
    assert sched.name == layout.schedule and sched.n_ranks == layout.pp


@pytest.mark.parametrize("settings,message", [
    (dict(schedule="1f1bb"), "unknown pipeline schedule"),
    (dict(schedule="interleaved-1f1b", microbatches=1), "multiple of 2"),
    (dict(pp=4, model={"n_layers": 2}), "every stage needs at least one block"),
    (dict(schedule="interleaved-1f1b", virtual_stages=3, model={"n_layers": 4}),
     "at least one block"),
    (dict(zero_stage=3), "ZeRO stage 3 with pipeline"),
])
def test_bad_settings_fail_before_any_process_waits(settings, message):
    cfg = pipeline_config(dp=1, **settings)
    with pytest.raises(PartitaError, match=message):
        _check(cfg)


def test_every_schedule_name_is_accepted():
    cfg = pipeline_config(dp=1)
    for name in schedule_names():
        cfg.parallel.schedule = name
        with contextlib.ExitStack() as stack:
            if name not in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):
                stack.enter_context(pytest.warns(FutureWarning, match="deprecated"))
            _check(cfg)
