"""How a dimension is cut between tensor-parallel ranks, and which layouts are valid.

Pure arithmetic, no processes: every rule here is unit-tested for many degrees.

Rules (docs/tensor_parallel.md explains them at length):

- query heads must divide evenly by tp; otherwise a PartitaError names the valid degrees;
- kv heads are split when n_kv_heads % tp == 0, otherwise every rank keeps all of them
  (replicated; each rank uses the ones its query heads need);
- the MLP hidden width and the vocabulary are cut as if padded up to a multiple of tp:
  rank r owns [r*c, min((r+1)*c, n)) with c = ceil(n / tp). The padding is never stored
  as parameters (so every parameter's ShardInfo describes exactly the rows it holds and
  `init_shard` builds it unchanged); logits are padded with -inf columns so every rank's
  logits have the same width. This is exact: the padding contributes nothing.
"""

from __future__ import annotations

import math

from partita.errors import PartitaError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def padded_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of `n` owned by `index` when `n` is padded to a multiple of `parts`."""
    chunk = math.ceil(n / parts)
    return min(index * chunk, n), min((index + 1) * chunk, n)


def padded_size(n: int, parts: int) -> int:
    return math.ceil(n / parts) * parts


def check_padded_split(n: int, parts: int, what: str) -> None:
    """Every rank must own at least one real row of a padded split."""
    if parts > 1 and padded_split(n, parts, parts - 1)[0] >= n:
        ok = [t for t in range(1, n + 1) if padded_split(n, t, t - 1)[0] < n]
        raise PartitaError(
            f"{what}={n} cannot be split over tp={parts} ranks: with padding to a multiple "
            f"of {parts} the last rank would own no real row. Use a tp degree among "
            f"{_short(ok)}."
        )


def head_split(n_heads: int, tp: int, index: int, what: str = "model.n_heads") -> tuple[int, int]:
    """[first, last) query/kv heads of rank `index`; heads must divide evenly."""
    if n_heads % tp:
        raise PartitaError(
            f"{what}={n_heads} is not divisible by tp={tp}: attention is split by heads, "
            f"so every rank needs the same number of whole heads. Valid tp degrees: "
            f"{divisors(n_heads)}."
        )
    per = n_heads // tp
    return index * per, (index + 1) * per


def kv_heads_needed(n_heads: int, n_kv_heads: int, q_first: int, q_last: int) -> list[int]:
    """The kv head each local query head reads, in order (grouped-query attention)."""
    group = n_heads // n_kv_heads
    return [q // group for q in range(q_first, q_last)]


def kv_rows_for_rank(n_heads: int, n_kv_heads: int, q_first: int, q_last: int) -> list[int]:
    """kv heads a rank computes when kv heads are replicated.

    The model's attention repeats each kv head n_local_q / n_local_kv times, so the
    local kv heads must map onto the local query heads in equal contiguous groups. When
    the needed heads already do (the usual case) each is computed once; otherwise one kv
    head per local query head is computed (repeats allowed).
    """
    needed = kv_heads_needed(n_heads, n_kv_heads, q_first, q_last)
    distinct = sorted(set(needed))
    rep = len(needed) // len(distinct)
    if len(needed) % len(distinct) == 0 and needed == [h for h in distinct for _ in range(rep)]:
        return distinct
    return needed


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 12 else f"{values[:12]} ..."
