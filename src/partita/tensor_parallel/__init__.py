"""Megatron tensor parallelism and sequence parallelism (see docs/tensor_parallel.md).

    report = apply_tensor_parallel(model, model.plan(), mesh.comm("tensor"))
    loss = report.loss_fn(model(tokens), targets)
"""

from partita.tensor_parallel.apply import (
    TensorParallelReport,
    apply_tensor_parallel,
    verify_tensor_parallel,
)
from partita.tensor_parallel.dropout import ParallelDropout, RegionRNG
from partita.tensor_parallel.layers import (
    ColumnParallelLinear,
    ReplicatedHeadsLinear,
    RowParallelLinear,
)
from partita.tensor_parallel.vocab import (
    VocabParallelEmbedding,
    VocabParallelHead,
    VocabParallelLoss,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear", "ParallelDropout", "RegionRNG", "ReplicatedHeadsLinear",
    "RowParallelLinear", "TensorParallelReport", "VocabParallelEmbedding",
    "VocabParallelHead", "VocabParallelLoss", "apply_tensor_parallel",
    "verify_tensor_parallel", "vocab_parallel_cross_entropy",
]
