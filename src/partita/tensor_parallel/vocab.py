"""Vocabulary-parallel embedding, output head and cross-entropy.

Rank r owns vocabulary rows [start, stop) of a vocabulary padded to a multiple of tp
(see partition.py); only the model's rows are stored, not that padding. (A model's own
padding, model.vocab_multiple, is stored rows like the others; the loss is given the
real vocabulary and ignores both.) Logits stay sharded along the vocabulary:
the full (tokens x vocab) logits never exist on one rank. The cross-entropy
(`partita.loss`) needs three all-reduces of one number per token in forward (max,
target logit, sum of exponentials) and none in backward, because each rank's softmax
slice is its gradient slice.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from partita.comm import GroupComm, copy_to_region, gather_sequence
from partita.loss import cross_entropy
from partita.tensor_parallel.layers import _local_param, check_sequence, leave_region


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of an Embedding; tokens outside the range contribute zeros.

    The partial embeddings are summed over tp (all-reduce), or under sequence
    parallelism reduce-scattered so the output is already this rank's sequence shard.
    """

    def __init__(self, embedding: nn.Embedding, start: int, stop: int, padded_rows: int,
                 comm: GroupComm, sequence_parallel: bool) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.start, self.stop, self.padded_rows = start, stop, padded_rows
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = _local_param(embedding.weight, 0, start, stop)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            check_sequence(tokens.shape[1], self.comm)
        outside = (tokens < self.start) | (tokens >= self.stop)
        local = (tokens - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(out, self.comm, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"rows[{self.start}:{self.stop}] of {self.num_embeddings} "
                f"(padded {self.padded_rows * self.comm.size}), tp={self.comm.size}")


class VocabParallelHead(nn.Module):
    """Logits for vocabulary rows [start, stop), padded with -inf to the padded width.

    The hidden state enters through f (or, under sequence parallelism, is all-gathered
    along the sequence first: the loss then sees every token of the sequence). With
    tied embeddings `tied` is the VocabParallelEmbedding whose weight serves as the
    head; it is held outside the module tree so the parameter is not listed twice.
    """

    def __init__(self, linear: nn.Linear | None, start: int, stop: int, padded_rows: int,
                 comm: GroupComm, sequence_parallel: bool,
                 tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.start, self.stop, self.padded_rows = start, stop, padded_rows
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self._tied = (tied,) if tied is not None else None
        if linear is not None:
            self.weight = _local_param(linear.weight, 0, start, stop)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = gather_sequence(h, self.comm) if self.sequence_parallel else copy_to_region(h, self.comm)
        weight = self._tied[0].weight if self._tied is not None else self.weight
        logits = F.linear(h, weight)
        pad = self.padded_rows - (self.stop - self.start)
        return F.pad(logits, (0, pad), value=float("-inf")) if pad else logits

    def extra_repr(self) -> str:
        tied = ", tied to the embedding" if self._tied is not None else ""
        return f"rows[{self.start}:{self.stop}] (+{self.padded_rows - self.stop + self.start} -inf){tied}"


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor,
                                 comm: GroupComm, vocab_start: int, vocab_size: int,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over counted tokens from vocabulary-sharded logits.

    `local_logits[..., j]` is the logit of token `vocab_start + j`; columns at or past
    `vocab_size` (padding) are ignored. `targets` holds global token ids (same on every
    tp rank); tokens equal to `ignore_index` are not counted. Equals
    `F.cross_entropy(full_logits.flatten(0, -2), targets.flatten(), ignore_index=...)`.
    The computation (in place, three all-reduces of a number per token) is
    `partita.loss.cross_entropy`'s.
    """
    return cross_entropy(local_logits, targets, comm, vocab_start, vocab_size, ignore_index)


class VocabParallelLoss:
    """The loss for a model whose head is vocabulary-parallel: `loss_fn(logits, targets)`.

    Knows the rank's vocabulary range and the padding, so the trainer does not.
    """

    def __init__(self, comm: GroupComm, vocab_start: int, vocab_size: int) -> None:
        self.comm, self.vocab_start, self.vocab_size = comm, vocab_start, vocab_size

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor,
                 ignore_index: int = -100) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.comm, self.vocab_start,
                                            self.vocab_size, ignore_index)
