"""Flat-slice initialisation for meta-device builds: from a model's plan (its ParamInit)
or a user's init function, and the check that nothing was left on meta."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from partita.errors import PartitaError
from partita.models.param_init import ParamInit
from partita.sharding import ShardInfo, init_shard
from partita.zero.flat import InitFn


def model_init_fn(init: ParamInit,
                  dtype: torch.dtype = torch.float32) -> InitFn:
    """init_fn(info, start, stop) drawing exactly the single-device values.

    An unsplit parameter draws only the chunks its flat range touches; a tensor-parallel
    shard (info.dim set) is materialised whole first -- one local tensor, never a model.
    Values are drawn in `dtype` (float32, as build_model does) and cast by the caller.
    `init` is the model plan's ParamInit.
    """

    def fn(info: ShardInfo, start: int, stop: int) -> torch.Tensor:
        if not info.is_split:
            return init.flat_slice(info.name, start, stop, dtype)
        return init_shard(init, info, dtype).reshape(-1)[start:stop]
    return fn


def flat_init_fn(init_fn) -> InitFn | None:
    """Accept init_fn(info, start, stop) or the simpler init_fn(info) -> local tensor
    (the latter materialises one parameter at a time, never the model)."""
    if init_fn is None or len(inspect.signature(init_fn).parameters) >= 3:
        return init_fn
    return lambda info, start, stop: init_fn(info).reshape(-1)[start:stop]


def check_nothing_left_on_meta(module: nn.Module) -> None:
    left = [n for n, p in module.named_parameters() if p.is_meta]
    left += [n for n, b in module.named_buffers() if b.is_meta]
    if left:
        raise PartitaError(
            f"'{left[0]}' is still on the meta device: DataParallel materialises trainable "
            "parameters only. Build frozen parameters (requires_grad=False) and buffers on "
            "a real device before wrapping, e.g. module.get_submodule(...).to_empty("
            "device=...) followed by their own initialisation."
        )


def device_of(module: nn.Module) -> torch.device:
    """Where a module's materialised parameters are (meta ones aside); else the current
    GPU, or the CPU."""
    for p in module.parameters():
        if not p.is_meta:
            return p.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
