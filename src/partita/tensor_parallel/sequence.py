"""Replicated modules that see sequence-sharded activations under sequence parallelism.

With sequence parallelism the norms (and a learned position embedding) work on this
rank's slice of the sequence, so each rank's gradient for their replicated weights
covers only its tokens. Using the weights through copy_to_region (identity forward,
all-reduce of the gradient backward) sums those partial gradients over tp inside
backward: data-parallel code then sees complete, identical gradients on every tp rank,
as without sequence parallelism.

The wrappers adopt the original module's parameters under the same names (so parameter
names, checkpoints and ShardInfo stay those of the single-device model) and call the
original module's forward with the parameters swapped in.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.func import functional_call

from partita.comm import GroupComm, copy_each_to_region
from partita.tensor_parallel.layers import check_sequence


class _SumGradOverTP(nn.Module):
    def __init__(self, inner: nn.Module, comm: GroupComm) -> None:
        super().__init__()
        self._inner = (inner,)  # not a child: its parameters are adopted below instead
        self.comm = comm
        for name, param in inner.named_parameters(recurse=False):
            setattr(self, name, param)

    def _call_inner(self, *args: torch.Tensor) -> torch.Tensor:
        # clone(): a norm saves its weight for backward. Saved as a view of the parameter
        # it would keep the parameter's storage alive until backward -- under ZeRO-3 the
        # whole gathered block buffer. A clone of a weight vector costs h elements.
        names = [n for n, p in self._parameters.items() if p is not None]
        copies = copy_each_to_region([self._parameters[n].clone() for n in names], self.comm)
        return functional_call(self._inner[0], dict(zip(names, copies)), args)

    def extra_repr(self) -> str:
        return f"{type(self._inner[0]).__name__}, gradients summed over tp={self.comm.size}"


class SequenceParallelNorm(_SumGradOverTP):
    """A norm applied to this rank's sequence shard."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._call_inner(x)


class SequenceShardedPositions(_SumGradOverTP):
    """A learned position embedding returning only this rank's slice of positions.

    The model adds `pos_embeddings(arange(seq))[None]` to the (sequence-sharded) token
    embeddings, so this returns the rows of this rank's sequence chunk.
    """

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        check_sequence(positions.shape[0], self.comm)
        local = positions.chunk(self.comm.size, dim=0)[self.comm.index]
        return self._call_inner(local)
