"""ZeRO pieces that need no second process: layout, block discovery, errors, ledger."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from partita.bench import zero_memory
from partita.errors import PartitaError
from partita.layout import Layout
from partita.memory.offload import OffloadPolicy
from partita.mesh import Mesh
from partita.models.transformer import transformer_init
from partita.testing import run_distributed
from partita.zero import ALIGN, DataParallel, FlatBuffer, MixedPrecision, ZeroConfig
from partita.zero.units import gather_units, resolve_blocks
from tests.dist import dp_cases as zp


def _mesh(rank: int = 0, world: int = 1) -> Mesh:
    return Mesh(Layout(dp=world), rank, world)


def test_flat_buffer_pads_to_aligned_equal_slices_and_maps_back() -> None:
    params = [("a", nn.Parameter(torch.randn(7, 5))), ("b", nn.Parameter(torch.randn(3)))]
    for index in range(4):
        buf = FlatBuffer(params, 4, index, torch.float32, torch.device("cpu"))
        assert buf.padded % (4 * ALIGN) == 0 and buf.shard_numel * 4 == buf.padded
        pieces = buf.owned_pieces()
        assert sum(pc.stop - pc.start for pc in pieces) == max(0, min(buf.hi, 38) - buf.lo)
    meta = buf.metadata()["entries"]
    assert [(e["name"], e["shape"], e["offset"]) for e in meta] == [("a", (7, 5), 0),
                                                                   ("b", (3,), 35)]


def test_blocks_by_plan_class_pattern_and_names() -> None:
    toy = zp.Toy()
    names = ["layers.0", "layers.1", "layers.2"]
    assert resolve_blocks(toy, zp.ToyLayer) == names
    assert resolve_blocks(toy, "layers.*") == names
    assert resolve_blocks(toy, names[:2]) == names[:2]
    assert resolve_blocks(zp.make_model({}, torch.float32), None) == ["blocks.0", "blocks.1"]
    with pytest.raises(PartitaError, match="Did you mean 'layers.1'"):
        resolve_blocks(toy, ["layer.1"])


def test_stage3_without_blocks_says_what_to_pass() -> None:
    with pytest.raises(PartitaError, match="blocks="):
        DataParallel(zp.Toy(), _mesh(), zero=ZeroConfig(stage=3))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_group_of_one_rank_runs_every_stage_as_stage_0(stage: int) -> None:
    # A shard of a one-rank group is the whole buffer: nothing to save, copies to pay.
    toy = zp.Toy().double()
    dp = DataParallel(toy, _mesh(), zero=ZeroConfig(stage=stage),
                      precision=MixedPrecision(param_dtype=torch.float64), blocks=zp.ToyLayer)
    assert int(dp.stage) == 0 and dp.gatherer is None
    assert all(p.numel() > 0 for p in toy.parameters())  # at rest, whole
    # Offloading moves the shards elsewhere, so it keeps the stage it was given.
    offloaded = DataParallel(zp.Toy().double(), _mesh(), zero=ZeroConfig(stage=stage),
                             precision=MixedPrecision(param_dtype=torch.float64),
                             blocks=zp.ToyLayer, offload=OffloadPolicy("optimizer"))
    assert int(offloaded.stage) == stage


def test_meta_model_without_init_fn_is_refused() -> None:
    model = zp.make_model({}, torch.float32, meta=True)
    with pytest.raises(PartitaError, match="init_fn"):
        DataParallel(model, _mesh(), zero=ZeroConfig(stage=3))


@pytest.mark.parametrize("bad", [dict(stage=4), dict(bucket_mb=0), dict(prefetch=-1),
                                 dict(keep_gathered=-1), dict(keep_gathered=1.5),
                                 dict(accumulation="later")])
def test_bad_zero_config(bad: dict) -> None:
    with pytest.raises(PartitaError):
        ZeroConfig(**bad)


def test_second_backward_without_grad_sync_is_an_error_not_a_wrong_gradient() -> None:
    dp = DataParallel(zp.make_model({}, torch.float64), _mesh(),
                      precision=MixedPrecision(param_dtype=torch.float64))
    tokens = zp.batch(0)
    dp.backward(zp.lm_loss(dp.module(tokens[:, :-1]), tokens))
    with pytest.raises(PartitaError, match="grad_sync"):
        dp.backward(zp.lm_loss(dp.module(tokens[:, :-1]), tokens))


def _writeback(rank: int, world: int) -> None:
    from partita.zero import model_init_fn

    model = zp.make_model({}, torch.float32, meta=True)
    dp = DataParallel(model, _mesh(rank, world), zero=ZeroConfig(stage=3),
                      precision=MixedPrecision(param_dtype=torch.bfloat16),
                      init_fn=model_init_fn(transformer_init(zp.CFG)))
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # at rest
    with dp.gathered_parameters(writeback=True):
        for p in model.parameters():
            p.fill_(0.5)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(bool((b.shard[: b.numel - b.lo] == 0.5).all()) for b in dp.buckets
               if b.numel > b.lo)
    assert all(bool((s.master == 0.5).sum() > 0) for s in dp.slots if s.master.numel())


def test_gathered_parameters_writeback_reaches_shards_and_master() -> None:
    run_distributed(_writeback, 2)


def test_memory_ledger_matches_zero_formulas_and_stage3_draws_only_its_shard() -> None:
    rows = run_distributed(zero_memory.measure, 2, args=(zp.CFG, (0, 1, 2, 3), 8))
    for rank_rows in rows:
        for r in rank_rows:
            measured = (r["parameters"] + r["gradients"] + r["master_weights"]
                        + r["optimizer_states"])
            f = zero_memory.formula(r["stage"], r["P"], 2)
            assert abs(measured - f) / f < 0.03, r  # only padding differs
            if r["stage"] == 3:
                assert r["at_rest_param_bytes"] == 0
                assert r["drawn"] <= r["P"] // 2 + 64 * 4
                # root + the computing unit + one prefetched unit, never more
                assert 0 < r["gathered_peak"] <= 3 * r["biggest_group"]


def _pieces_grads(stage: int, in_pieces: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    toy = zp.Toy().double()
    dp = DataParallel(toy, _mesh(), zero=ZeroConfig(stage=stage, bucket_mb=0.005),
                      precision=MixedPrecision(param_dtype=torch.float64))
    tokens = zp.batch(0)
    with dp.grad_sync(True):
        h1 = toy.layers[0](toy.emb(tokens[:, :-1]))
        if in_pieces:  # as a pipeline does: the later stage first, then the earlier one
            h1_in = h1.detach().requires_grad_()
            out = toy.head(toy.layers[2](toy.layers[1](h1_in)))
            zp.lm_loss(out, tokens).backward()
            torch.autograd.backward(h1, h1_in.grad)
        else:
            zp.lm_loss(toy.head(toy.layers[2](toy.layers[1](h1))), tokens).backward()
    dp.finish_grad_sync()
    return [dp._owned_grad(b).clone() for b in dp.buckets]


@pytest.mark.parametrize("stage", [1, 2])
def test_backward_in_pieces_gives_the_same_gradients(stage: int) -> None:
    whole, pieces = _pieces_grads(stage, False), _pieces_grads(stage, True)
    assert len(whole) > 1
    for a, b in zip(whole, pieces):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=0)


def test_frozen_parameter_left_on_meta_is_named() -> None:
    model = zp.make_model({}, torch.float32, meta=True)
    model.norm.weight.requires_grad_(False)
    from partita.zero import model_init_fn

    with pytest.raises(PartitaError, match="'norm.weight' is still on the meta device"):
        DataParallel(model, _mesh(), zero=ZeroConfig(stage=3), init_fn=model_init_fn(transformer_init(zp.CFG)))


@pytest.mark.parametrize("stage", [0, 1])
def test_one_rank_accumulates_into_bound_buckets(stage: int) -> None:
    """One rank, stages 0-1: .grad are the buckets' views and autograd adds into them."""
    dp = DataParallel(zp.make_model({}, torch.float64), _mesh(), zero=ZeroConfig(stage=stage),
                      precision=MixedPrecision(param_dtype=torch.float64))
    plain = zp.make_model({}, torch.float64)
    tokens = zp.batch(0)
    for _step in range(2):
        for m, micro in enumerate(tokens.chunk(2)):
            with dp.grad_sync(m == 1):
                dp.backward(zp.lm_loss(dp.module(micro[:, :-1]), micro) / 2)
            (zp.lm_loss(plain(micro[:, :-1]), micro) / 2).backward()
        dp.finish_grad_sync()
        for (name, a), b in zip(dp.module.named_parameters(), plain.parameters()):
            assert a.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-12), name
        # Bound: every .grad is a view into its bucket, so the flat optimizer sees it.
        assert all(p.grad.untyped_storage().data_ptr() ==
                   buf.full_grad.untyped_storage().data_ptr()
                   for buf in dp.buckets for p in buf.params)
        dp.zero_grad()
        plain.zero_grad()
        # As torch's zero_grad: .grad is None; the next gradient overwrites the bucket.
        assert all(p.grad is None for p in dp.module.parameters())
    # A .grad dropped by user code means "discard": the bucket reads zeros for it.
    dp.backward(zp.lm_loss(dp.module(tokens[:, :-1]), tokens))
    first = next(dp.module.parameters())
    first.grad = None
    dp.finish_grad_sync()
    assert first.grad is not None and float(first.grad.abs().sum()) == 0
    assert any(float(p.grad.abs().sum()) > 0 for p in dp.module.parameters())


def test_gather_units_merge_consecutive_blocks_up_to_the_bucket_size() -> None:
    block = [[("w", nn.Parameter(torch.empty(100)))] for _ in range(5)]  # 400 bytes each
    assert gather_units(block, 1000, 4) == [[0, 1], [2, 3], [4]]
    assert gather_units(block, 10, 4) == [[0], [1], [2], [3], [4]]  # too big: one each
    assert gather_units(block, 2000, 4) == [[0, 1, 2, 3, 4]]


def _stage3_collectives(rank: int, world: int, bucket_mb: float, recompute: bool,
                        keep: int = 1) -> dict:
    mesh = Mesh(Layout(dp=world), rank, world)
    torch.manual_seed(0)
    toy = zp.Toy(recompute=recompute).double()
    dp = DataParallel(toy, mesh, zero=ZeroConfig(stage=3, bucket_mb=bucket_mb,
                                                 keep_gathered=keep),
                      precision=MixedPrecision(param_dtype=torch.float64), blocks=zp.ToyLayer)
    tokens = zp.batch(rank)
    for _ in range(2):  # the second step is counted
        mesh.counter.reset()
        dp.backward(zp.lm_loss(dp.module(tokens[:, :-1]), tokens))
        dp.finish_grad_sync()
        dp.step()
        dp.zero_grad()
    assert dp.gatherer.live_bytes == 0  # kept or not, every unit is freed by its backward
    if keep != 1:  # the most gathered at once, in units beside the root (equal layers)
        units = {b.padded * 8 for _, b in dp.gatherer.blocks}
        assert len(units) == 1, units
        peak = (dp.gatherer.peak_bytes - dp.gatherer.root.padded * 8) / units.pop()
        n, k = len(dp.gatherer.blocks), min(keep, len(dp.gatherer.blocks))
        # Forward: the unit computing and the one prefetched; backward's start: the kept
        # units and the one prefetched before them (what the planner counts).
        assert peak == max(2, k + min(1, n - k)), (keep, peak)
    return {op: n for (purpose, op), n in mesh.counter.calls.items() if purpose == "zero_shard"}


@pytest.mark.parametrize("bucket_mb,recompute,gathers,reductions", [
    # Each ToyLayer is ~19 KB in float64: three units of one layer each. Forward gathers
    # the root and the three units, backward the first two again (the root and the last
    # unit stay gathered from forward into backward); recomputing a layer inside
    # backward gathers nothing more.
    (0.001, False, 6, 4), (0.001, True, 6, 4),
    # All three layers in one unit: root + unit in forward only.
    (1.0, False, 2, 2), (1.0, True, 2, 2)])
def test_stage3_issues_one_gather_and_one_reduction_per_unit(
        bucket_mb: float, recompute: bool, gathers: int, reductions: int) -> None:
    calls = run_distributed(_stage3_collectives, 2, args=(bucket_mb, recompute))[0]
    assert calls == {"all_gather": gathers, "reduce_scatter": reductions}


@pytest.mark.parametrize("keep,recompute,gathers", [
    # Three one-layer units and the root (always kept): forward gathers four, backward
    # gathers again each unit not kept.
    (0, False, 7), (2, False, 5), (3, False, 4), (99, False, 4),
    # A recomputed layer's forward inside backward frees nothing that is kept.
    (3, True, 4)])
def test_stage3_keeps_the_last_units_gathered_into_backward(keep: int, recompute: bool,
                                                            gathers: int) -> None:
    calls = run_distributed(_stage3_collectives, 2, args=(0.001, recompute, keep))[0]
    assert calls == {"all_gather": gathers, "reduce_scatter": 4}


def test_stage3_frees_parameters_that_autograd_saved_for_backward() -> None:
    """A linear layer saves its weight for backward. Freeing a unit after its forward
    must release that memory too (the saved views are re-filled by the backward gather),
    or stage 3 holds every unit from forward until backward, more than stage 2."""
    run_distributed(_frees_saved_parameters, 2)


def _frees_saved_parameters(rank: int, world: int) -> None:
    torch.manual_seed(0)
    toy = zp.Toy().double()
    dp = DataParallel(toy, _mesh(rank, world), zero=ZeroConfig(stage=3, bucket_mb=1e-6),
                      precision=MixedPrecision(param_dtype=torch.float64), blocks=zp.ToyLayer)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter):
            t = t.detach()  # what autograd keeps: the storage as it is now
            saved.append(t)
        return t

    tokens = zp.batch(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = zp.lm_loss(dp.module(tokens[:, :-1]), tokens)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    held = sum(storages.values())
    assert len(saved) >= 6  # the three layers' two weights, at least
    # Still gathered after forward: the root (the head's backward comes first) and the
    # last layer, prefetched for backward.
    assert 0 < held <= dp.gatherer.live_bytes
    dp.backward(loss)  # the saved views are valid again once their unit is regathered
    dp.finish_grad_sync()
    assert dp.gatherer.live_bytes == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in toy.parameters())
    # At rest a parameter reads as an empty tensor (a view of the emptied buffer would
    # crash the process), and a forward still works.
    assert all(p.numel() == 0 and float(p.detach().sum()) == 0.0 for p in toy.parameters())
    assert torch.isfinite(zp.lm_loss(dp.module(tokens[:, :-1]), tokens))
