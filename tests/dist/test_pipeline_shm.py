"""Pipeline transfers through shared-memory rings (`partita.shm_channel`):
bytes in order at every size (empty, one slot, past the ring), receivers that wait
before the sender starts, sends queued while a ring is full, and whole pipeline steps
bitwise equal to gloo's transfers under every schedule. (Large transfers both ways at
once: tests/dist/test_pipeline_steps.py.)"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from partita.layout import Layout
from partita import shm_channel
from partita.pipeline.p2p import neighbour_pairs
from partita.shm_channel import SLOT_BYTES, SLOTS
from partita.testing import run_distributed, token_batch
from tests.dist.pipeline_cases import pipeline_config

FLOATS_PER_SLOT = SLOT_BYTES // 4
# Empty, one float, exactly a slot, a slot and one more, more than the whole ring, then
# enough small ones that the ring fills and later sends queue behind the first.
SIZES = [0, 1, FLOATS_PER_SLOT, FLOATS_PER_SLOT + 1, SLOTS * FLOATS_PER_SLOT * 3 + 7,
         *[1000] * (2 * SLOTS)]


def _pattern(k: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 3 + k


def _rings(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    from partita.mesh import Mesh

    pairs = neighbour_pairs(2, lambda s: s)
    comm = Mesh(Layout(pp=2), rank, world).comm("pipeline")
    channels = shm_channel.open_channels(comm, pairs, 30.0)
    out: dict = {"pairs": pairs, "open": channels is not None}
    if rank == 0:
        time.sleep(0.3)  # the receiver is waiting in an empty ring by now
        sends = [(channels.send(1, t), t) for t in
                 (_pattern(k, n) for k, n in enumerate(SIZES))]
        out["inline"] = sum(h.is_completed() for h, _ in sends[:2])
        out["queued"] = channels.outboxes[1]._queue is not None
        for handle, _ in sends:
            handle.wait()
    else:
        received = [(channels.recv(0, t), t) for t in (torch.empty(n) for n in SIZES)]
        received[-1][0].wait()  # completes every receive before it, in order
        out["done_before"] = all(h.is_completed() for h, _ in received)
        out["equal"] = [torch.equal(t, _pattern(k, t.numel()))
                        for k, (_, t) in enumerate(received)]
    dist.barrier()
    return out


def test_rings_deliver_every_size_in_order() -> None:
    sender, receiver = run_distributed(_rings, 2, timeout=60)
    assert sender["pairs"] == [(0, 1), (1, 0)]
    assert sender["open"] and receiver["open"]
    assert sender["inline"] == 2  # room in the ring: sent before send() returned
    assert sender["queued"]  # the ring filled: later sends went through the helper
    assert receiver["done_before"]
    assert receiver["equal"] == [True] * len(SIZES)


def _steps(rank: int, world: int, settings: dict) -> dict:
    """Two training steps and an evaluation with the transfers through the rings and
    through gloo (`Mesh(shm_collectives=False)`), same weights and batches."""
    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model

    torch.set_num_threads(1)
    cfg = pipeline_config(**settings)
    model = cfg.model_config()
    out = {}
    for shared in (True, False):
        torch.manual_seed(0)
        mesh = Mesh(Layout(pp=2), rank, world, shm_collectives=shared)
        pm = build_parallel_model(cfg, mesh, torch.device("cpu"))
        m, losses = cfg.train.microbatches, []
        for step in range(2):
            tokens = token_batch(step, cfg.train.global_batch, cfg.data.seq_len,
                                 model.vocab_size)
            losses.append(pm.runner.train(tokens[:, :-1], tokens[:, 1:], m))
        pm.dp.finish_grad_sync()
        losses.append(pm.runner.evaluate(tokens[:, :-1], tokens[:, 1:]))
        tied = pm.runner.tied
        out[shared] = {"rings": pm.runner.transport.channels is not None, "losses": losses,
                       "tied_rings": None if tied is None else tied.rings is not None,
                       "grads": {n: p.grad.clone() for n, p in pm.module.named_parameters()
                                 if p.grad is not None}}
    return out


@pytest.mark.parametrize("settings", [
    {"schedule": "gpipe"},
    {"schedule": "interleaved-1f1b", "virtual_stages": 2, "microbatches": 8},
    {"schedule": "zb-h1", "model": {"tie_embeddings": True}},
], ids=["gpipe", "interleaved", "zb-h1-tied"])
def test_steps_through_the_rings_equal_gloo_bitwise(settings: dict) -> None:
    for rank, out in enumerate(run_distributed(_steps, 2, (settings,), timeout=170)):
        rings, gloo = out[True], out[False]
        assert rings["rings"] and not gloo["rings"], rank
        tied = (settings.get("model") or {}).get("tie_embeddings", False)
        assert (rings["tied_rings"], gloo["tied_rings"]) == ((True, False) if tied
                                                             else (None, None)), rank
        assert rings["losses"] == gloo["losses"], rank
        assert rings["grads"].keys() == gloo["grads"].keys() and rings["grads"], rank
        for name, grad in rings["grads"].items():
            assert torch.equal(grad, gloo["grads"][name]), (rank, name)
