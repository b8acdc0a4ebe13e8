"""Mixture-of-experts feed-forwards under tensor parallelism (`parallel.moe_tp`).

Attention and the dense MLPs are split over the tensor-parallel group; an MoE
feed-forward is not a column/row pair, so it takes one of three forms:

- "replicate": every tp rank holds the whole feed-forward (router, all experts, shared
  experts) and computes the same output. Nothing is exchanged over tp, but the experts'
  compute, weights and activations are not divided by tp.
- "experts": the tp ranks split the experts between them (Megatron's former
  "moe-extended-tp", or its expert tensor parallelism of 1 with tp ranks counted as
  expert-parallel ones): each holds E/tp of them (then divided again by ep) and 1/tp of
  the shared experts' width, and runs only the choices of its own experts.
- "hidden": the tp ranks split each expert's width (Megatron's expert tensor
  parallelism equal to tp): each holds every expert (E/ep of them) with 1/tp of its
  hidden units, and runs every choice through its slice, like a dense tensor-parallel
  MLP. Balanced whatever the routing, and E need not divide by tp; thinner GEMMs.

In both split forms every tp rank still routes every token alike (the router is
replicated) and the partial outputs are summed over tp on leaving: an all-reduce, or
under sequence parallelism the reduce-scatter that also cuts the sequence back. In
backward, the experts' inputs and gate weights collect partial gradients on each rank;
`ExpertsOverTP.inputs` sums them (f: identity forward, one all-reduce of both in
backward), while the router's other paths (the auxiliary losses) are complete on every
rank already.

Under sequence parallelism the feed-forward computes on the whole sequence, gathered on
entry (`WholeSequence`), so routing, capacity and the per-sequence balance loss are the
same as in one process. The MoE module calls the edges itself (`MoE.edges`): each is
one deliberate graph break in compiled code, like its other collectives.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from partita.comm import (
    GroupComm,
    copy_each_to_region,
    gather_sequence_to_replica,
    reduce_from_region,
    reduce_scatter_sequence,
    scatter_sequence,
)
from partita.errors import PartitaError
from partita.models.moe import EXPERT_PARAMS, MoE
from partita.sharding import ShardInfo, set_shard_info, shard_info
from partita.tensor_parallel import partition as part


class WholeSequence:
    """Sequence parallelism's edges of a feed-forward every tp rank computes on the
    whole sequence. Entering all-gathers the sequence; its backward keeps this rank's
    slice of the gradient, which every rank holds complete and alike. Leaving cuts the
    output back to this rank's shard (`summed`: first summing the ranks' partial
    outputs, one reduce-scatter; its backward all-gathers)."""

    def __init__(self, comm: GroupComm, summed: bool = False) -> None:
        self.comm, self.summed = comm, summed

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return gather_sequence_to_replica(x, self.comm)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        if self.summed:
            return reduce_scatter_sequence(y, self.comm)
        return scatter_sequence(y, self.comm)


class SummedOutput:
    """Without sequence parallelism, the edges of a feed-forward whose tp ranks each
    compute part of the output: summed on leaving (g: all-reduce, identity backward)."""

    def __init__(self, comm: GroupComm) -> None:
        self.comm = comm

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        return reduce_from_region(y, self.comm)


class ExpertsOverTP:
    """`MoE.share`: this tp rank runs experts first..first+count-1 (all of them under
    moe_tp="hidden", each through its slice of the width)."""

    def __init__(self, comm: GroupComm, first: int, count: int) -> None:
        self.comm, self.first, self.count = comm, first, count

    def inputs(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return copy_each_to_region(tensors, self.comm)


def split_moe_over_tp(name: str, moe: MoE, comm: GroupComm, mode: str = "experts") -> None:
    """Keep this tp rank's share of an MoE feed-forward, tagged with its ShardInfo:
    mode "experts" a block of the stacked experts, "hidden" a slice of every expert's
    width; either way a slice of the shared experts' width. The router stays whole (the
    caller marks it replicated)."""
    tp, index, n_experts = comm.size, comm.index, moe.cfg.n_experts
    experts = moe.experts
    if mode == "experts":
        if n_experts % tp:
            raise PartitaError(
                f"parallel.moe_tp='experts' splits the experts over the tp ranks, but "
                f"model.n_experts={n_experts} is not divisible by parallel.tp={tp}. Use "
                "parallel.moe_tp='hidden' or 'replicate', or experts divisible by tp."
            )
        count = n_experts // tp
        first = index * count
        for pname in EXPERT_PARAMS:
            _keep_slice(experts, pname, f"{name}.experts.{pname}", 0, first, first + count)
        experts.first, experts.n_local = first, count
        moe.share = ExpertsOverTP(comm, first, count)
    else:  # "hidden": w_gate, w_up (E, ffn, dim) by rows; w_down (E, dim, ffn) by columns
        width = experts.w_gate.shape[1]
        if width % tp:
            raise PartitaError(
                f"parallel.moe_tp='hidden' splits each expert's width over the tp ranks, "
                f"but it is {width}, not divisible by parallel.tp={tp}. Use "
                "parallel.moe_tp='experts' or 'replicate', or another model.expert_ffn_dim."
            )
        lo, hi = index * width // tp, (index + 1) * width // tp
        for pname, dim in (("w_gate", 1), ("w_up", 1), ("w_down", 2)):
            _keep_slice(experts, pname, f"{name}.experts.{pname}", dim, lo, hi)
        moe.share = ExpertsOverTP(comm, 0, n_experts)
    if moe.shared is not None:
        width = moe.shared.w_gate.out_features
        part.check_padded_split(width, tp, f"{name}.shared width")
        lo, hi = part.padded_split(width, tp, index)
        for pname, dim in (("w_gate", 0), ("w_up", 0), ("w_down", 1)):
            _keep_linear_slice(moe.shared, pname, f"{name}.shared.{pname}", dim, lo, hi)


def _keep_slice(module: nn.Module, attr: str, full_name: str, dim: int, start: int,
                stop: int) -> None:
    old = getattr(module, attr)
    before = shard_info(old, full_name)
    shape = list(old.shape)
    shape[dim] = stop - start
    if old.is_meta:
        value = torch.empty(shape, device="meta", dtype=old.dtype)
    else:
        value = old.detach().narrow(dim, start, stop - start).clone()
    # A frozen expert weight stays frozen (fine-tuning only part of a model).
    new = nn.Parameter(value, requires_grad=old.requires_grad)
    set_shard_info(new, ShardInfo(full_name, tuple(before.global_shape), dim, start, stop))
    setattr(module, attr, new)


def _keep_linear_slice(parent: nn.Module, attr: str, full_name: str, dim: int, start: int,
                       stop: int) -> None:
    """Cut the bias-free nn.Linear `parent.attr` in place to its slice along `dim` of the
    weight (0: output features, 1: input features)."""
    linear = getattr(parent, attr)
    _keep_slice(linear, "weight", f"{full_name}.weight", dim, start, stop)
    linear.out_features, linear.in_features = linear.weight.shape
