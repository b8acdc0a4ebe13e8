"""The memory ledger: bytes a data-parallel rank holds, by category, counted from its
tensors (`DataParallel.memory_ledger()` calls this; the planner's figures are checked
against it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from partita.zero.engine import DataParallel


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def memory_ledger(dp: DataParallel) -> dict[str, int]:
    """Bytes this rank holds, counted from the actual tensors."""
    params = sum(_nbytes(b.full) + _nbytes(b.shard) for b in dp.buckets)
    if dp.gatherer is not None:  # at rest: shards only; gathered units separately
        params = sum(_nbytes(b.shard) for b in dp.buckets)
    # A full gradient buffer is part of the model states where it lives for the
    # whole run; a transient one (sharded gradients) is a communication buffer.
    grads = sum(_nbytes(b.shard_grad)
                + (0 if dp.stage.shards_gradients else _nbytes(b.full_grad))
                for b in dp.buckets)
    host = dp.host.bytes() if dp.host is not None else {}
    if dp.disk is not None:  # the engine's bounded buffers; the states are on disk
        host = {"optimizer_buffers": dp.disk.buffer_bytes()}
    if dp.offload.params and dp.disk is None:
        host["parameters"] = params
        params = 0
    on_device = dp.host is None
    out = {
        "parameters": params,
        "gradients": grads,
        "master_weights": on_device * sum(_nbytes(s.master) for s in dp.slots),
        "optimizer_states": on_device * sum(_nbytes(s.exp_avg) + _nbytes(s.exp_avg_sq)
                                            for s in dp.slots),
        "comm_buffers": dp.reducer.live_bytes,
    }
    out["model_states"] = sum(out.values())
    # Of the parameters, the experts this rank holds (E/ep of each MoE block; at rest).
    out["expert_parameters"] = sum(
        _nbytes(b.shard) + (0 if dp.gatherer is not None else _nbytes(b.full))
        for b in dp.buckets if b.comm is not None)
    # Host memory (offload): master weights, moments, the gradients' staging buffers
    # and, under "optimizer+params", the parameter shards.
    for name in ("parameters", "gradients", "master_weights", "optimizer_states"):
        out[f"host_{name}"] = host.get(name, 0)
    out["host_model_states"] = sum(host.values())
    if dp.disk is not None:
        out["host_optimizer_buffers"] = host["optimizer_buffers"]
        out["disk_bytes"] = dp.disk.disk_bytes()
    out["comm_buffers_peak"] = dp.reducer.peak_bytes
    out["optimizer_scratch"] = _nbytes(dp.adam_scratch)  # at most one adamw chunk
    if dp.gatherer is not None:
        out["gathered_now"] = dp.gatherer.live_bytes
        out["gathered_peak"] = dp.gatherer.peak_bytes
    return out
