"""Load-balanced causal sharding of a sequence over the context-parallel group.

With degree c each sequence is cut into 2c equal chunks and rank r holds chunks r and
2c-1-r, in that order. Under a causal mask chunk j attends to j+1 chunks, so every rank
holds (r+1) + (2c-r) = 2c+1 chunk pairs of work: the same on every rank, where a plain
cut into c pieces would leave the last rank c times the first rank's work.

Pure index arithmetic, unit-tested without processes.
"""

from __future__ import annotations

import torch

from partita.errors import PartitaError


def chunks_of(rank: int, degree: int) -> tuple[int, int]:
    """The two chunk indices (of 2*degree) that `rank` holds, in local order."""
    if not 0 <= rank < degree:
        raise ValueError(f"rank {rank} outside a context-parallel group of {degree}")
    return rank, 2 * degree - 1 - rank


def visible(rank: int, src: int, n: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of the one block where `rank`'s local queries see
    the pair of n-token chunks that `src` holds; every other query and key of the two
    pairs is hidden by the causal mask.

    Own pair: local order is sequence order, so it is causal over the 2n local rows.
    An earlier rank's pair: both query chunks see its first chunk, neither its second.
    A later rank's pair: only the second query chunk sees it, and sees all of it."""
    if src == rank:
        return slice(0, 2 * n), slice(0, 2 * n), True
    if src < rank:
        return slice(0, 2 * n), slice(0, n), False
    return slice(n, 2 * n), slice(0, 2 * n), False


def own_blocks(n: int) -> tuple[tuple[slice, slice, bool], list[tuple[slice, slice, bool]]]:
    """The own pair's causal block split in two, each part (query rows, key rows, causal):
    the full block (second query chunk against first key chunk), then the two diagonal
    blocks. A backward computes the first part while keys travel and the second while
    gradients travel."""
    first, second = slice(0, n), slice(n, 2 * n)
    return (second, first, False), [(first, first, True), (second, second, True)]


def check_length(seq_len: int, degree: int) -> None:
    if seq_len % (2 * degree):
        raise PartitaError(
            f"sequence length {seq_len} is not divisible by 2*cp={2 * degree}: context "
            "parallelism cuts every sequence into 2*cp equal chunks. Use a multiple of "
            f"{2 * degree}."
        )


def positions(rank: int, degree: int, local_len: int) -> torch.Tensor:
    """True token positions of the `local_len` tokens `rank` holds (RoPE reads them)."""
    if local_len % 2:
        raise PartitaError(f"a context-parallel shard of {local_len} tokens is not two "
                           "equal chunks.")
    n = local_len // 2
    a, b = chunks_of(rank, degree)
    return torch.cat((torch.arange(a * n, (a + 1) * n), torch.arange(b * n, (b + 1) * n)))


def shard(x: torch.Tensor, rank: int, degree: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (the sequence), concatenated."""
    if degree == 1:
        return x
    check_length(x.shape[dim], degree)
    pieces = x.chunk(2 * degree, dim=dim)
    a, b = chunks_of(rank, degree)
    return torch.cat((pieces[a], pieces[b]), dim=dim)


def unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard (rank order): the inverse of `shard`."""
    degree = len(shards)
    pieces: list[torch.Tensor | None] = [None] * (2 * degree)
    for rank, x in enumerate(shards):
        a, b = chunks_of(rank, degree)
        pieces[a], pieces[b] = x.chunk(2, dim=dim)
    return torch.cat(pieces, dim=dim)
