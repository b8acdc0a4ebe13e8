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
from partita.models.model_config import ModelConfig


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


def check_tensor_parallel(cfg: ModelConfig, tp: int, sequence_parallel: bool = False,
                          seq_len: int | None = None,
                          world_size: int | None = None) -> list[str]:
    """Validate a model for tensor parallelism of degree `tp`; return the adjustments made.

    Raises PartitaError with what to change for an impossible layout. The returned notes
    describe exact adjustments (padding, replicated kv heads) worth logging.
    """
    notes: list[str] = []
    if tp < 1:
        raise PartitaError(f"parallel.tp={tp} is invalid: use a positive integer.")
    if world_size is not None and tp > world_size:
        raise PartitaError(
            f"parallel.tp={tp} is larger than the {world_size} processes started; tensor "
            f"parallelism needs tp ranks. Start at least {tp} processes or lower tp to a "
            f"value among {[d for d in divisors(world_size) if d <= world_size]}."
        )
    if sequence_parallel and tp == 1:
        raise PartitaError(
            "sequence parallelism shards activations over the tensor-parallel group, but "
            "parallel.tp=1. Set parallel.tp to 2 or more, or turn sequence parallelism off."
        )
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise PartitaError(
            f"sequence length {seq_len} is not divisible by tp={tp}; sequence parallelism "
            f"cuts the sequence into tp equal pieces. Use a sequence length that is a "
            f"multiple of {tp}, or a tp degree among {divisors(seq_len)}."
        )
    head_split(cfg.n_heads, tp, 0)
    if cfg.kv_heads % tp:
        notes.append(
            f"kv heads ({cfg.kv_heads}) not divisible by tp={tp}: wk/wv are replicated on "
            f"every tp rank (+{2 * cfg.dim * cfg.kv_heads * cfg.head_dim * (tp - 1) // tp} "
            "parameters per layer per rank versus sharding, and an all-reduce of their "
            "gradients over tp)."
        )
    check_padded_split(cfg.ffn_hidden, tp, "model ffn hidden width")
    if cfg.ffn_hidden % tp:
        notes.append(
            f"ffn hidden width {cfg.ffn_hidden} padded to {padded_size(cfg.ffn_hidden, tp)} "
            f"for tp={tp} (exact; the last rank holds fewer columns)."
        )
    check_padded_split(cfg.vocab_size, tp, "model.vocab_size")
    if cfg.vocab_size % tp:
        notes.append(
            f"vocabulary {cfg.vocab_size} padded to {padded_size(cfg.vocab_size, tp)} for "
            f"tp={tp}; padded logits are -inf and receive no probability mass."
        )
    return notes


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 12 else f"{values[:12]} ..."
