"""Stopping every process of a job together when some of them fail at the same point.

Work that each process does on its own (reading its part of a checkpoint) can fail on
some processes only. Left alone, each failing process prints its error and exits, and
the others wait in their next collective until it times out. `stop_together` agrees
first: one message, and every process stops at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.errors import PeerReported


def stop_together(failure: BaseException | None, device: torch.device, what: str) -> None:
    """Every process calls this at the same point, after work that may fail on some of
    them only (`what`, e.g. "reading the checkpoint"): if any failed, the lowest-numbered
    of those raises its own error and every other process raises PeerReported. So the job
    stops everywhere at once, with one message, rather than with one per process or with
    the others waiting in their next collective until it times out."""
    alone = not dist.is_initialized() or dist.get_world_size() == 1
    world, rank = (1, 0) if alone else (dist.get_world_size(), dist.get_rank())
    (first,) = over_all_ranks([rank if failure is not None else world], dist.ReduceOp.MIN,
                              device)
    first = int(first)
    if first == world:
        return
    if first == rank:
        raise failure
    raise PeerReported(f"process {first} failed while {what} and reports why; this "
                       "process stopped with it.")


def over_all_ranks(values: list[float], op: dist.ReduceOp, device: torch.device
                   ) -> list[float]:
    """`values` reduced with `op` over every process of the job (as they are in a job of
    one process). Small integers come back exactly."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    # NCCL reduces CUDA tensors only, gloo CPU ones.
    place = device if device.type == "cuda" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=place)
    dist.all_reduce(t, op=op)
    return t.tolist()
