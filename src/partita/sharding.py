"""What a local tensor is a shard of.

Every parameter that parallel code splits carries a `ShardInfo`: its global name, its
global shape, and which slice of which dimension this rank holds. Checkpoints, the
gradient-norm computation and the planner read this metadata, never the classes of
tensor-parallel layers or ZeRO buffers. A model a pipeline cut carries the stages this
rank kept (`mark_pipeline_stages`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from partita.models.param_init import ParamInit

_ATTR = "partita_shard"


Cut = tuple[int, int, int]  # (dim, start, stop): narrow(dim, start, stop - start)


@dataclass(frozen=True)
class ShardInfo:
    """This rank holds global[name].narrow(dim, start, stop - start); dim None = whole.

    `more` are further cuts along other dimensions, for a tensor two groups split (an
    expert stack: experts over the expert-parallel ranks, each expert's width over the
    tensor-parallel ones); only a split tensor has them.

    `replicated_over` names the mesh purposes whose members hold identical copies (for
    example "tensor" for a norm weight under tensor parallelism); a gradient norm counts
    such a tensor once, not once per copy.
    """

    name: str
    global_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0
    replicated_over: tuple[str, ...] = ()
    more: tuple[Cut, ...] = ()

    def __post_init__(self) -> None:
        if self.more and self.dim is None:
            raise ValueError(f"{self.name}: further cuts need a first one (dim)")

    @property
    def is_split(self) -> bool:
        return self.dim is not None

    @property
    def cuts(self) -> tuple[Cut, ...]:
        """Every cut, the first one first."""
        return () if self.dim is None else ((self.dim, self.start, self.stop), *self.more)

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        for dim, start, stop in self.cuts:
            shape[dim] = stop - start
        return tuple(shape)


def set_shard_info(tensor: torch.Tensor, info: ShardInfo) -> None:
    setattr(tensor, _ATTR, info)


def has_shard_info(tensor: torch.Tensor) -> bool:
    """Whether tensor parallelism has described this tensor (split or replicated)."""
    return getattr(tensor, _ATTR, None) is not None


def shard_info(tensor: torch.Tensor, name: str | None = None) -> ShardInfo:
    """The tensor's ShardInfo; an unsplit tensor gets one describing it whole."""
    info = getattr(tensor, _ATTR, None)
    if info is not None:
        return info
    if name is None:
        raise ValueError("tensor has no shard metadata; pass its global name")
    return ShardInfo(name=name, global_shape=tuple(tensor.shape))


def init_shard(init: ParamInit, info: ShardInfo,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of this shard (`init`: the model plan's), equal to the same slice of a
    single-device init."""
    if info.dim is None:
        return init.slice(info.name, info.global_shape, 0, 0, info.global_shape[0], dtype)
    values = init.slice(info.name, info.global_shape, info.dim, info.start, info.stop, dtype)
    for dim, start, stop in info.more:  # the first cut drawn, the others cut from it
        values = values.narrow(dim, start, stop - start)
    return values.contiguous() if info.more else values


# A parameter whose gradient is reduced (and whose ZeRO state is sharded) over another
# group than the dense parameters' zero_shard group: experts, held by one expert-parallel
# rank and replicated over the expert-data-parallel group ("expert_grad_reduce").
_GROUP_ATTR = "partita_reduce_group"


def set_reduce_group(tensor: torch.Tensor, purpose: str) -> None:
    setattr(tensor, _GROUP_ATTR, purpose)


def reduce_group(tensor: torch.Tensor) -> str:
    """The mesh purpose `tensor`'s gradient is reduced over ("zero_shard" unless set)."""
    return getattr(tensor, _GROUP_ATTR, "zero_shard")


# The mark a pipeline cut leaves on the model it cut: the stages this rank runs. The
# data-parallel engine reads it to refuse a pipeline mesh around a whole, uncut model,
# whose copies on the pp ranks would each train on their own.
_STAGES_ATTR = "_partita_pipeline_stages"


def mark_pipeline_stages(model: torch.nn.Module, stages: Iterable[int]) -> None:
    setattr(model, _STAGES_ATTR, tuple(stages))


def pipeline_stages(model: torch.nn.Module) -> tuple[int, ...] | None:
    """The stages a pipeline cut left on `model`, or None if no pipeline cut it."""
    return getattr(model, _STAGES_ATTR, None)
