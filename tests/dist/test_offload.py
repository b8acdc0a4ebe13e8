"""Offload of model states to host memory (partita.memory.offload in the ZeRO engine).

On a CPU machine host and device are one memory, so what can be checked is: parity
(float64 within 1e-10 of one process, and bitwise the same layout without offload,
mixed precision included), the ledger (which bytes are "device" and which "host",
exactly the owned slices), the order of the copies (each gradient to host as its
bucket's reduction lands during backward, in reduction order; then each bucket's
update and its parameters' return, in the order the next forward needs them; under
optimizer+params each gather preceded by its shard's copy in), the checkpoint
accessor, and bad settings.
"""

from __future__ import annotations

import threading

import pytest
import torch

from partita.errors import PartitaError
from partita.layout import Layout
from partita.layout_rules import validate
from partita.memory import OffloadPolicy
from partita.mesh import Mesh
from partita.models.model_config import ModelConfig
from partita.models.transformer import build_model
from partita.parallelize import build_parallel_model
from partita.testing import PARITY_MODEL, Case, check_layouts, parity_config, run_layouts
from partita.zero import DataParallel, ZeroConfig
from tests.dist.pipeline_cases import pipeline_config

STEPS = 3


def _cfg(**parallel):
    return parity_config(parallel=dict(bucket_mb=0.01, **parallel))


TWO = [
    Case("dp2-zero1-optimizer", _cfg(dp=2, zero_stage=1, offload="optimizer"), params=True),
    Case("dp2-zero3-optimizer+params", _cfg(dp=2, zero_stage=3, offload="optimizer+params"),
         params=True),
    Case("tp2-optimizer", _cfg(tp=2, offload="optimizer"), params=True),
    Case("pp2-zb-optimizer", pipeline_config(schedule="zb-h1", offload="optimizer"),
         params=True),
]


def test_two_ranks_match_one_process() -> None:
    check_layouts(TWO, 2, STEPS, timeout=200)


def test_mixed_precision_is_bitwise_the_run_without_offload(tmp_path) -> None:
    """bf16 parameters, fp32 master weights: on the host, on disk or not, the same
    numbers (the disk case: partita.memory.disk, sub-groups of a 0.5 MB budget)."""
    def case(zero: int, off: str) -> Case:
        cfg = parity_config(parallel=dict(dp=2, zero_stage=zero, offload=off, bucket_mb=0.01,
                                          offload_dir=str(tmp_path),
                                          host_memory_budget_gb=0.0005),
                            train=dict(dtype="bfloat16"))
        return Case(f"z{zero}-{off}", cfg, params=True)
    cases = [case(2, "none"), case(2, "optimizer"), case(3, "none"),
             case(3, "optimizer+params"), case(3, "optimizer+params+disk")]
    runs = run_layouts(cases, 2, STEPS, timeout=200)
    for base, other in ((runs[0], runs[1]), (runs[2], runs[3]), (runs[2], runs[4])):
        for rank in range(2):
            assert other[rank]["losses"] == base[rank]["losses"]
            assert other[rank]["norms"] == base[rank]["norms"]
            for name, (_, value) in base[rank]["params"].items():
                assert torch.equal(other[rank]["params"][name][1], value), name


def _engine(stage: int, offload: str, dtype: str = "float64") -> DataParallel:
    cfg = _cfg(zero_stage=stage, offload=offload)
    cfg.train.dtype = dtype
    return build_parallel_model(cfg, Mesh(cfg.layout(1).degrees, 0, 1), torch.device("cpu")).dp


def _train_step(dp: DataParallel) -> None:
    tokens = torch.randint(64, (2, 17), generator=torch.Generator().manual_seed(0))
    logits = dp.module(tokens[:, :-1])
    dp.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
    dp.finish_grad_sync()
    dp.clip_grad_norm_(1.0)
    dp.step()
    dp.zero_grad()


@pytest.mark.parametrize("stage,offload", [(0, "optimizer"), (3, "optimizer+params")])
def test_ledger_puts_offloaded_states_on_the_host(stage: int, offload: str) -> None:
    plain, off = _engine(stage, "none", "bfloat16"), _engine(stage, offload, "bfloat16")
    a, b = plain.memory_ledger(), off.memory_ledger()
    owned = sum(s.exp_avg.numel() for s in off.slots)  # elements this rank updates
    assert b["master_weights"] == b["optimizer_states"] == 0
    assert b["host_master_weights"] == 4 * owned  # fp32 master of bf16 parameters
    assert b["host_optimizer_states"] == 8 * owned
    assert b["host_gradients"] == 2 * owned  # staging for the bf16 gradients
    assert b["gradients"] == 2 * owned  # the reduced gradients stay on the device
    # Without offload a group of one rank runs every stage as stage 0 (`DataParallel`),
    # so only stage 0 has a like-for-like engine here.
    if int(plain.stage) == int(off.stage):
        assert a["optimizer_states"] == 8 * owned and a["gradients"] == b["gradients"]
    if offload == "optimizer+params":
        assert b["parameters"] == 0 and b["host_parameters"] == 2 * owned
    else:
        assert b["parameters"] == a["parameters"] and b["host_parameters"] == 0
    assert b["host_model_states"] == sum(b[k] for k in b if k.startswith("host_")
                                         and k != "host_model_states")
    assert all(t.device.type == "cpu" for s in off.slots for t in (s.master, s.exp_avg))


def _backward(dp: DataParallel, seed: int = 0) -> None:
    tokens = torch.randint(64, (2, 17), generator=torch.Generator().manual_seed(seed))
    logits = dp.module(tokens[:, :-1])
    dp.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))


@pytest.mark.parametrize("stage,offload", [(1, "optimizer"), (3, "optimizer+params")])
def test_gradients_stream_to_host_during_backward(stage: int, offload: str) -> None:
    """Each bucket's gradient is copied to host as its reduction lands, in reduction
    order, while backward goes on; the updates and the parameters' return follow in the
    order the next forward needs them."""
    dp = _engine(stage, offload)
    buckets = len(dp.buckets)
    assert buckets > 2  # several buckets: the order means something
    _backward(dp)
    during = list(dp.host.copies)
    dp.finish_grad_sync()
    reduced = [dp._owned_grad(buf).clone() for buf in dp.buckets]
    dp.clip_grad_norm_(None)
    dp.step()
    dp.wait_params()  # the update runs in the background
    copies, after = dp.host.copies, dp.host.copies[len(during):]
    # Stages 0-1 launch the bucket of the first layers (no hooks) when backward is over.
    last = buckets - 1 if stage < 2 else buckets
    assert [b for kind, b in during if kind == "d2h"] == list(range(last))
    assert [c for c in after if c[0] == "d2h"] == [("d2h", b) for b in range(last, buckets)]
    back = "shard" if "+params" in offload else "h2d"
    order = list(reversed(range(buckets)))
    assert [c for c in after if c[0] != "d2h"] == [(k, b) for b in order for k in ("adam", back)]
    if stage == 3:
        # Under ZeRO-3 each unit's gradient leaves after its backward gather (the root
        # and the last unit, bucket 0, gathered once in forward, stay gathered).
        gathers = [b for kind, b in copies if kind == "param-in"]
        blocks_forward = list(reversed(range(buckets - 1)))
        assert gathers == [buckets - 1] + blocks_forward + blocks_forward[::-1][1:]
        for b in range(buckets):
            last_gather = max(i for i, c in enumerate(copies) if c == ("param-in", b))
            assert copies.index(("d2h", b)) > last_gather
    # The update read the reduced gradients (the host copies are exactly those).
    for b in range(buckets):
        assert torch.equal(dp.host.grads[b], reduced[b])


def _hold_update(dp: DataParallel, bucket: int, until: threading.Event) -> None:
    """Bucket `bucket`'s background update waits (at most 10 s) for `until`."""
    inner = dp.host.step

    def held(b, *args, **kwargs):
        if b == bucket and not until.wait(10):
            raise RuntimeError("the update was held and nothing released it")
        inner(b, *args, **kwargs)
    dp.host.step = held


@pytest.mark.parametrize("stage,offload", [(0, "optimizer"), (2, "optimizer"),
                                           (3, "optimizer+params")])
def test_next_forward_overlaps_the_host_update(stage: int, offload: str) -> None:
    """The update runs in the background in forward order: the first module's forward
    starts while the last bucket's update is still held back (it is released from
    inside that forward, so a forward that waited for the whole step would fail)."""
    dp = _engine(stage, offload)
    _backward(dp)
    dp.clip_grad_norm_(None)
    forward_began = threading.Event()
    _hold_update(dp, 0, forward_began)  # bucket 0 (the last layers) is updated last

    def began(module, args) -> None:
        dp.host.copies.append(("forward", -1))
        forward_began.set()
    dp.module.tok_embeddings.register_forward_pre_hook(began)
    dp.step()
    _backward(dp, 1)  # waits module by module; raises if the held update failed
    back = "shard" if "+params" in offload else "h2d"
    copies = dp.host.copies
    assert copies.index(("forward", -1)) < copies.index((back, 0))
    assert copies.index((back, len(dp.buckets) - 1)) < copies.index(("forward", -1))


def test_readers_join_the_update_and_its_errors_surface() -> None:
    """Checkpoint reads wait for the whole background update; an error raised there is
    raised in the training thread, by the next forward and by every later wait."""
    dp = _engine(2, "optimizer")
    _backward(dp)
    release = threading.Event()
    _hold_update(dp, 0, release)
    dp.step()
    threading.Timer(0.2, release.set).start()
    dp.owned_slices()
    assert ("h2d", 0) in dp.host.copies
    _backward(dp, 1)
    dp.clip_grad_norm_(None)

    def fails(b, *args, **kwargs):
        raise ValueError(f"bucket {b} broke")
    dp.host.step = fails
    dp.step()
    with pytest.raises(PartitaError, match="bucket 14 broke"):
        _backward(dp, 2)
    with pytest.raises(PartitaError, match="host optimizer step failed"):
        dp.wait_params()


def test_accumulation_copies_each_gradient_once_when_final() -> None:
    """ZeRO-3 reduces every microbatch; only the last round's results go to host."""
    dp = _engine(3, "optimizer+params")
    with dp.grad_sync(False):
        _backward(dp, 0)
    assert not [c for c in dp.host.copies if c[0] == "d2h"]
    with dp.grad_sync(True):
        _backward(dp, 1)
    dp.finish_grad_sync()
    assert [b for kind, b in dp.host.copies if kind == "d2h"] == list(range(len(dp.buckets)))
    for b, buf in enumerate(dp.buckets):
        assert torch.equal(dp.host.grads[b], dp._owned_grad(buf))


def test_checkpoint_accessor_returns_the_host_shards() -> None:
    dp = _engine(2, "optimizer", "bfloat16")
    _train_step(dp)
    slices = dp.owned_slices()
    assert len(slices) == len(dp.buckets)
    for sl, slot in zip(slices, dp.slots):
        assert sl.master is slot.master and sl.master.dtype == torch.float32
        assert sl.master.device.type == "cpu"
        assert sl.exp_avg is slot.exp_avg and sl.exp_avg.abs().sum() > 0
    plain = _engine(0, "none")  # float64: no separate master, the parameters themselves
    assert plain.owned_slices()[0].master is None
    assert plain.owned_slices()[0].param.data_ptr() == plain.buckets[0].full.data_ptr()


def test_bad_settings_fail_before_training() -> None:
    model = ModelConfig(**PARITY_MODEL)
    with pytest.raises(PartitaError, match="zero_stage=3"):
        validate(Layout(zero_stage=1, offload="optimizer+params"), model, 1, seq_len=16,
                 global_batch=8)
    with pytest.raises(PartitaError, match="unknown"):
        Layout(offload="gpu")
    with pytest.raises(PartitaError, match="unknown"):
        OffloadPolicy("params")
    with pytest.raises(PartitaError, match="no parameter shards"):
        DataParallel(build_model(model), Mesh(Layout().degrees, 0, 1),
                     zero=ZeroConfig(stage=2), offload=OffloadPolicy("optimizer+params"))
