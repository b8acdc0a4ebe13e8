"""Context parallelism: every sequence split over the "context" group.

`sharding` cuts sequences into load-balanced chunks; `ring` and `allgather` are the two
kinds of distributed causal attention (autograd Functions over partita's counted
collectives); `apply` swaps a model's planned attention cores and shards each step's
batch. docs/context_parallel.md explains the design and the communication volume.
"""

from partita.context_parallel.apply import (
    KINDS,
    ContextParallelAttention,
    ContextParallelRunner,
    apply_context_parallel,
)

__all__ = ["KINDS", "ContextParallelAttention", "ContextParallelRunner",
           "apply_context_parallel"]
