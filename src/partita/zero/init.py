"""Flat-slice initialisation of partita's own transformer, for meta-device builds."""

from __future__ import annotations

import torch

from partita.models.config import ModelConfig
from partita.models.init import init_flat_slice
from partita.models.transformer import init_rule
from partita.sharding import ShardInfo, init_shard
from partita.zero.flat import InitFn


def model_init_fn(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> InitFn:
    """init_fn(info, start, stop) drawing exactly the single-device values.

    An unsplit parameter draws only the chunks its flat range touches; a tensor-parallel
    shard (info.dim set) is materialised whole first -- one local tensor, never a model.
    Values are drawn in `dtype` (float32, as build_model does) and cast by the caller.
    """
    def fn(info: ShardInfo, start: int, stop: int) -> torch.Tensor:
        if not info.is_split:
            return init_flat_slice(init_rule(cfg, info.name), cfg.seed, info.name, start,
                                   stop, dtype)
        return init_shard(cfg, info, dtype).reshape(-1)[start:stop]
    return fn
