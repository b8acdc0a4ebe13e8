"""Flat-slice initialisation from a model's plan (its ParamInit), for meta-device builds."""

from __future__ import annotations

import torch

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
