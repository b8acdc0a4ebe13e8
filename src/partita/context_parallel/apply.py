"""Apply context parallelism to a model through its plan, and shard a step's batch.

The plan names each attention core (role `attention_core`: a parameter-free module
called as core(q, k, v) that computes causal attention). `apply_context_parallel` swaps
every core for `ContextParallelAttention`, which runs the ring or all-gather kind over
the "context" group, and gives the core's parent (the attention module, which applies
the rotary embedding) the true positions of the rank's tokens through its
`position_offset` argument. The model itself stays single-device code.

`ContextParallelRunner` wraps a step runner: it keeps this rank's two chunks of every
sequence (inputs and targets alike) before the runner sees them. The loss each rank
returns is the mean over its own tokens; every rank holds as many tokens, so the mean
over the data x context ranks (the "loss_average" group) is the mean over the global
batch, and gradients averaged over the same ranks are its gradients.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from partita.comm import GroupComm
from partita.context_parallel import sharding
from partita.context_parallel.allgather import allgather_attention
from partita.context_parallel.clock import IDLE, AttentionClock
from partita.context_parallel.moe_routing import SplitSequence
from partita.context_parallel.ring import ring_attention
from partita.eager_only import EagerOnly
from partita.errors import PartitaError
from partita.models import plan as roles
from partita.models.moe import planned_moe_modules

KINDS = {"ring": ring_attention, "allgather": allgather_attention}


class ContextParallelAttention(nn.Module):
    """Causal attention of this rank's query chunks against the whole sequence's keys.

    Takes what the model's core takes: q (b, h, s, d) and k, v with h heads (repeated
    per grouped-query group, as the model's attention hands them) or with the kv heads
    only. Repeated heads are dropped before anything travels: `kv_group` query heads
    share each kv head.
    """

    # The model may hand k and v with their kv heads only (no repeat per query head).
    takes_kv_heads = True
    # No s x s scores are kept (only q, k, v, the merged output and a log-sum-exp per
    # query), so selective recomputation leaves this core alone (memory.recompute).
    saves_scores = False

    def __init__(self, comm: GroupComm, kind: str, kv_group: int) -> None:
        super().__init__()
        if kind not in KINDS:
            raise PartitaError(f"parallel.cp_kind='{kind}' is unknown; use "
                               f"{' or '.join(KINDS)}.")
        self.comm, self.kind, self.kv_group = comm, kind, kv_group
        # Set an `AttentionClock` to time this core's compute apart from its transfers.
        self.clock: AttentionClock | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        """`segments` (b, s): the documents of the whole sequence, not of this rank's
        chunks (the runner hands the model the unsharded numbering), so every piece
        knows the documents of its keys without communication."""
        return _attend(self, q, k, v, segments)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, cp={self.comm.size}, kv_group={self.kv_group}"


# Kept out of compiled code: the ring posts asynchronous sends and receives that dynamo
# cannot trace, so a compiled block runs this core eagerly between two compiled
# pieces, as it does tensor parallelism's collectives.
@EagerOnly
def _attend(core: ContextParallelAttention, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    if k.shape[1] == q.shape[1] and core.kv_group > 1:
        k, v = k[:, ::core.kv_group], v[:, ::core.kv_group]
    if segments is not None:
        segments = segments.to(q.device)
    return KINDS[core.kind](q, k, v, core.comm, 1.0 / math.sqrt(q.shape[-1]), segments,
                            core.clock or IDLE)


def apply_context_parallel(model: nn.Module, plan: roles.ModelPlan, comm: GroupComm,
                           kind: str) -> list[str]:
    """Swap every planned attention core of `model` for its context-parallel version
    over `comm`; the names of the swapped cores. Apply after tensor parallelism (the
    cores then see the local heads, and the positions hook runs after the region's)."""
    names = [n for n, _ in model.named_modules() if n and plan.role_of(n) == roles.ATTENTION_CORE]
    if not names:
        raise PartitaError(
            "context parallelism needs the model's attention cores, but its plan names "
            "none (role 'attention_core': the module computing softmax(q k^T) v). Add "
            "them to the model's plan, or set parallel.cp=1."
        )
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, ContextParallelAttention(comm, kind, _kv_group(parent, plan)))
        parent.register_forward_pre_hook(_positions_hook(comm), with_kwargs=True)
    for _, moe in planned_moe_modules(model, plan):  # each routes its own tokens
        moe.split = SplitSequence(comm)
    return names


def _kv_group(attention: nn.Module, plan: roles.ModelPlan) -> int:
    """Query heads per kv head in this (possibly tensor-parallel) attention module."""
    shape = plan.shape
    if shape is None or shape.kv_heads == shape.n_heads:
        return 1
    wq, wk = getattr(attention, "wq", None), getattr(attention, "wk", None)
    if wq is None or wk is None:
        return shape.n_heads // shape.kv_heads
    # The local widths: tensor parallelism may have split (or replicated) the kv heads.
    return wq.weight.shape[0] // wk.weight.shape[0]


def _positions_hook(comm: GroupComm):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        x = args[0] if args else next(iter(kwargs.values()))
        positions = sharding.positions(comm.index, comm.size, x.shape[1])
        return args, {**kwargs, "position_offset": positions}

    return hook


class ContextParallelRunner:
    """A step runner that hands its inner runner this rank's chunks of every sequence."""

    def __init__(self, inner, comm: GroupComm) -> None:
        self.inner, self.comm = inner, comm

    def _mine(self, x: torch.Tensor) -> torch.Tensor:
        return sharding.shard(x, self.comm.index, self.comm.size, dim=1)

    # Document numbers (`segments`) pass whole: the attention pieces index them by the
    # true positions of their queries and keys.
    def train(self, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
              segments: torch.Tensor | None = None,
              targets_per_rank: float | None = None) -> float:
        return self.inner.train(self._mine(inputs), self._mine(targets), microbatches,
                                segments, targets_per_rank)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 segments: torch.Tensor | None = None,
                 targets_per_rank: float | None = None) -> float:
        return self.inner.evaluate(self._mine(inputs), self._mine(targets), segments,
                                   targets_per_rank)

    def __getattr__(self, name: str):
        # Anything else (timelines, transports) is the inner runner's.
        return getattr(self.inner, name)
