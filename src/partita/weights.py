"""Write the trained model as one safetensors file of full, unsharded weights.

The file holds the same tensor names and shapes as a single-device model, whatever the
layout that trained it, so `partita generate` and other tools read it directly. Writing
is atomic: a temporary file is renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from partita.agreement import stop_together
from partita.checkpoint.files import write_file
from partita.comm import gather_along
from partita.errors import PartitaError
from partita.run_dir import PARTIAL_SUFFIX
from partita.sharding import reduce_group, shard_info
from partita.zero.masters import MasterCopies


def gather_full(param: torch.Tensor, name: str, comm,
                local: torch.Tensor | None = None) -> torch.Tensor:
    """The full global tensor of a (possibly tensor-parallel) parameter.

    Shards may differ in size (a vocabulary or MLP width not divisible by tp gives the
    last ranks fewer rows), so each is padded to the widest before the gather and cut
    back to its own extent afterwards. `local`: the values to gather (default the
    parameter's own), e.g. its master copy.
    """
    info = shard_info(param, name)
    local = param.detach() if local is None else local
    if not info.is_split or comm.size == 1:
        return local.clone()
    bounds = gather_along(torch.tensor([[info.start, info.stop]],
                                       device=comm.scalar_device), comm, 0).tolist()
    width = max(stop - start for start, stop in bounds)
    pad = [0, 0] * (local.ndim - 1 - info.dim) + [0, width - local.shape[info.dim]]
    gathered = gather_along(torch.nn.functional.pad(local, pad), comm, info.dim)
    pieces = [gathered.narrow(info.dim, r * width, stop - start)
              for r, (start, stop) in enumerate(bounds)]
    return torch.cat(pieces, dim=info.dim)


def full_state_dict(pm) -> dict[str, torch.Tensor] | None:
    """Full weights on global rank 0 (None elsewhere); every rank must call this.

    Under mixed precision these are the optimizer's fp32 master weights, not their
    bf16/fp16 copies in the module (`partita.zero.masters`)."""
    mesh, dp = pm.mesh, pm.dp
    tp_comm = mesh.comm("tensor")
    state: dict[str, torch.Tensor] = {}
    masters = MasterCopies.of(dp)
    with contextlib.nullcontext() if masters else dp.gathered_parameters():
        for name, param in dp.module.named_parameters():
            value = masters.value(param) if masters else param.detach()
            if reduce_group(param) == "zero_shard":
                full = gather_full(param, name, tp_comm, value)
            else:  # experts: split over their expert group, then over tp or replicated
                info = shard_info(param)
                full = gather_full(param, name, mesh.comm("expert"), value)
                for dim, _, _ in info.more:  # moe_tp="hidden": each expert's width over tp
                    full = gather_along(full.contiguous(), tp_comm, dim)
                if tuple(full.shape) != info.global_shape:
                    full = gather_along(full.contiguous(), tp_comm, 0)  # moe_tp="experts"
            state[name] = full.to("cpu", torch.float32 if full.is_floating_point() and
                                  full.dtype != torch.float64 else full.dtype)
    if mesh.dims.pp > 1:
        # Each stage holds different parameters: the first rank of every stage's
        # (dp, tp) slice sends its part to global rank 0.
        holder = state if mesh.coord.dp == 0 and mesh.coord.tp == 0 else {}
        parts = [None] * mesh.world_size if mesh.rank == 0 else None
        dist.gather_object(holder, parts, dst=0)
        if mesh.rank == 0:
            state = {k: v for part in parts for k, v in part.items()}
    return state if mesh.rank == 0 else None


def save_weights(pm, path: str | Path) -> None:
    """Gather and write the full weights (rank 0 writes; every rank must call).

    The file takes its name only once every process has come through the write: one
    that stopped or hung meanwhile (those with no part left to send included) fails the
    job within the collective timeout and leaves nothing, rather than being waited for
    without end after rank 0 has finished."""
    state = full_state_dict(pm)
    path = Path(path)
    tmp = path.with_suffix(path.suffix + PARTIAL_SUFFIX)
    try:
        failure = None
        if state is not None:
            try:
                _folder_made_again(path.parent)
                # partita's own safetensors writer, not the safetensors package's: its
                # errors are OSErrors (a full disk is said as such), it syncs the file
                # before the name is given, and the file gets the mode of the run's
                # other results rather than 0600.
                tmp.unlink(missing_ok=True)
                write_file(tmp, {k: v.contiguous() for k, v in state.items()},
                           {"format": "partita", "model": "transformer"})
            except OSError as exc:
                full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                fix = ("Free disk space or choose another train.out_dir." if full else
                       "Check that train.out_dir can be written, or choose another.")
                failure = PartitaError(
                    f"writing the weights to '{path}' failed ({exc.strerror or exc}); "
                    f"nothing was left behind. {fix}")
        stop_together(failure, pm.device, "writing the weights")
        if state is not None:
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise PartitaError(f"naming the weights '{path}' failed "
                                   f"({exc.strerror or exc}); nothing was left behind.") from None
    finally:
        if state is not None:  # a write that did not finish leaves nothing
            with contextlib.suppress(OSError):  # (a read-only folder: there is nothing)
                tmp.unlink(missing_ok=True)


def _folder_made_again(folder: Path) -> None:
    """Make `folder` again when it was removed while the run trained (an `rm -rf` of the
    run's folder, a cleanup job): the weights, the run's whole result, still land, and
    a warning says what went with the folder."""
    if folder.is_dir():
        return
    folder.mkdir(parents=True, exist_ok=True)
    print(f"partita: warning: train.out_dir '{folder}' was removed while the run trained; "
          "it is made again for the final weights. The run's config.toml and "
          "metrics.jsonl went with it (the config is in the run's checkpoints, if any).",
          file=sys.stderr, flush=True)


def nonfinite_tensors(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors that hold a NaN or an infinity."""
    return [name for name, t in state.items()
            if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a weights file; PartitaError naming the file when it is unreadable,
    truncated, corrupt, or holds NaN or infinite values."""
    try:
        state = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error type, or OSError
        raise PartitaError(
            f"the weights file '{path}' cannot be read ({exc}); it is truncated or corrupt. "
            "Train again, or copy the file again from where it was written."
        ) from None
    bad = nonfinite_tensors(state)
    if bad:
        raise PartitaError(
            f"the weights file '{path}' holds NaN or infinite values in {', '.join(bad[:3])}"
            f"{' and more' if len(bad) > 3 else ''}; the run that wrote it diverged. Train "
            "again with a lower train.lr or gradient clipping."
        )
    return state
