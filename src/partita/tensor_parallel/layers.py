"""Column- and row-parallel linear layers (Megatron), and a replicated-heads projection.

A column-parallel layer holds a block of output features; a row-parallel layer holds
the matching block of input features. Chained column -> row they need one collective
per direction: the input enters the region through f (identity forward, all-reduce
backward) and the output leaves through g (all-reduce forward, identity backward).
Under sequence parallelism f becomes an all-gather along the sequence (reduce-scatter
backward) and g a reduce-scatter (all-gather backward): the same bytes, but the
activations outside the region stay sequence-sharded.

Several column layers often read the same tensor (wq, wk, wv; w_gate, w_up). Entering
the region once per layer would triple the backward all-reduces, so `enter_region` is
also installed as a forward pre-hook on their common parent (see apply.py): the parent
enters once and tags the tensor, and column layers skip tensors already entered.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from partita.comm import (
    GroupComm,
    copy_to_region,
    gather_sequence,
    reduce_from_region,
    reduce_scatter_sequence,
)
from partita.errors import PartitaError

_ENTERED = "_partita_tp_entered"


def enter_region(x: torch.Tensor, comm: GroupComm, sequence_parallel: bool) -> torch.Tensor:
    """f (or the sequence all-gather) unless `x` has already entered this region."""
    if getattr(x, _ENTERED, None) is comm:
        return x
    if sequence_parallel:
        y = gather_sequence(x, comm)
    else:
        y = copy_to_region(x, comm)
    if y is x:  # tp=1: nothing happened, nothing to tag (x may belong to the caller)
        return y
    setattr(y, _ENTERED, comm)
    return y


def leave_region(y: torch.Tensor, comm: GroupComm, sequence_parallel: bool) -> torch.Tensor:
    """g (or the sequence reduce-scatter): sum the partial outputs of the region."""
    if sequence_parallel:
        return reduce_scatter_sequence(y, comm)
    return reduce_from_region(y, comm)


def check_sequence(length: int, comm: GroupComm) -> None:
    """A full sequence about to be cut into tp pieces must divide evenly."""
    if length % comm.size:
        raise PartitaError(
            f"sequence length {length} is not divisible by tp={comm.size}; sequence "
            f"parallelism cuts the sequence into tp equal pieces. Use a multiple of "
            f"{comm.size}, or turn sequence parallelism off."
        )


def region_pre_hook(comm: GroupComm, sequence_parallel: bool):
    """Forward pre-hook for a module whose column-parallel children share its input.

    The region's input is the module's first forward argument, passed by position or by
    keyword (`self_attn(hidden_states=h)`): entering it here, once, means the children
    skip it, and under sequence parallelism the module itself sees the whole sequence
    (models reshape with their input's shape).
    """
    first_name: dict[type, str | None] = {}

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if args:
            if isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                return (enter_region(args[0], comm, sequence_parallel), *args[1:]), kwargs
            return None
        kind = type(module)
        if kind not in first_name:
            first_name[kind] = _first_parameter(module)
        key = first_name[kind]
        x = kwargs.get(key) if key is not None else None
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return args, {**kwargs, key: enter_region(x, comm, sequence_parallel)}
        return None

    return hook


def _first_parameter(module: nn.Module) -> str | None:
    """Name of the first parameter of module.forward that can be passed by keyword."""
    for p in inspect.signature(module.forward).parameters.values():
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            return p.name
        if p.kind == p.VAR_POSITIONAL:
            return None
    return None


def _local_param(source: torch.Tensor | None, dim: int, start: int,
                 stop: int) -> nn.Parameter | None:
    """The [start, stop) slice of `source` along `dim` (a meta tensor for a meta source).

    The slice keeps the source's `requires_grad`: a frozen weight (fine-tuning only some
    of a model) must stay frozen, or the optimizer would train it.
    """
    if source is None:
        return None
    if source.is_meta:
        shape = list(source.shape)
        shape[dim] = stop - start
        value = torch.empty(shape, device="meta", dtype=source.dtype)
    else:
        value = source.detach().narrow(dim, start, stop - start).clone()
    return nn.Parameter(value, requires_grad=source.requires_grad)


def _whole_param(source: torch.Tensor | None) -> nn.Parameter | None:
    if source is None:
        return None
    return source if isinstance(source, nn.Parameter) else nn.Parameter(source)


class ColumnParallelLinear(nn.Module):
    """Output features [start, stop) of a Linear; the output stays feature-sharded."""

    def __init__(self, linear: nn.Linear, start: int, stop: int, comm: GroupComm,
                 sequence_parallel: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, stop - start
        self.start, self.stop = start, stop
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = _local_param(linear.weight, 0, start, stop)
        self.bias = _local_param(linear.bias, 0, start, stop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.linear_input(x), self.weight, self.bias)

    def linear_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the local weight is applied to: `x` entered into the region (for a
        caller that applies the weight itself, `rotary.pairs_as_halves`)."""
        return enter_region(x, self.comm, self.sequence_parallel)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out[{self.start}:{self.stop}], tp={self.comm.size}"


class RowParallelLinear(nn.Module):
    """Input features [start, stop) of a Linear; partial outputs are summed over tp.

    The bias is replicated and added once, after the sum. Under sequence parallelism it
    is added to a sequence shard, so each rank's bias gradient is partial: the bias is
    used through copy_to_region, whose backward sums the gradient over tp.
    """

    def __init__(self, linear: nn.Linear, start: int, stop: int, comm: GroupComm,
                 sequence_parallel: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = stop - start, linear.out_features
        self.start, self.stop = start, stop
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = _local_param(linear.weight, 1, start, stop)
        self.bias = _whole_param(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_region(F.linear(x, self.weight), self.comm, self.sequence_parallel)
        if self.bias is None:
            return y
        bias = copy_to_region(self.bias, self.comm) if self.sequence_parallel else self.bias
        return y + bias

    def extra_repr(self) -> str:
        return f"in[{self.start}:{self.stop}], out={self.out_features}, tp={self.comm.size}"


class ReplicatedHeadsLinear(nn.Module):
    """A kv projection kept whole on every rank (kv heads not divisible by tp).

    Each rank computes only the kv heads its query heads read (`heads`). Different ranks
    read different heads, so each rank's weight gradient is partial: the weight is used
    through copy_to_region, whose backward sums the gradient over tp, leaving identical
    (replicated) gradients everywhere.
    """

    def __init__(self, linear: nn.Linear, heads: list[int], head_dim: int,
                 comm: GroupComm, sequence_parallel: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, len(heads) * head_dim
        self.heads = heads
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = _whole_param(linear.weight)
        self.bias = _whole_param(linear.bias)
        # Not a buffer: `to_empty` (meta materialisation) would wipe a buffer's values.
        self._rows = [h * head_dim + i for h in heads for i in range(head_dim)]
        self._rows_on: dict[torch.device, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_region(x, self.comm, self.sequence_parallel)
        rows = self._rows_on.get(x.device)
        if rows is None:
            rows = self._rows_on[x.device] = torch.tensor(self._rows, device=x.device)
        weight = copy_to_region(self.weight, self.comm).index_select(0, rows)
        bias = None
        if self.bias is not None:
            bias = copy_to_region(self.bias, self.comm).index_select(0, rows)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, heads={self.heads} (replicated), tp={self.comm.size}"
