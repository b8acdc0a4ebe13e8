"""Which transformer blocks each pipeline stage holds.

Stages get contiguous runs of blocks. By default the split is even (earlier stages
take the remainder). With `costs` (one number per block: parameters or FLOPs) the
split balances the heaviest stage instead; `first_extra` / `last_extra` add the cost
of the embedding on the first stage and of the output head (and loss) on the last,
which otherwise make those stages the slow ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from partita.errors import PartitaError


def split_blocks(
    n_blocks: int,
    n_stages: int,
    costs: Sequence[float] | None = None,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> list[range]:
    """Contiguous block ranges, one per stage, every stage non-empty.

    Even split when `costs` is None and there are no extras; otherwise the split that
    minimises the most expensive stage (on ties earlier stages take more), found by binary
    search on that maximum with a greedy fill.
    """
    if n_stages < 1:
        raise PartitaError(f"the number of pipeline stages must be at least 1; got {n_stages}.")
    if n_blocks < n_stages:
        raise PartitaError(
            f"cannot split {n_blocks} transformer blocks into {n_stages} pipeline stages "
            "(pipeline stages x virtual stages): every stage needs at least one block. Use "
            f"at most {n_blocks} stages, fewer virtual stages, or a deeper model."
        )
    if costs is None and first_extra == 0 and last_extra == 0:
        base, rem = divmod(n_blocks, n_stages)
        bounds = [0]
        for s in range(n_stages):
            bounds.append(bounds[-1] + base + (1 if s < rem else 0))
        return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]
    weights = [1.0] * n_blocks if costs is None else [float(c) for c in costs]
    if len(weights) != n_blocks:
        raise PartitaError(f"got {len(weights)} block costs for {n_blocks} blocks; give one each.")
    if any(w < 0 for w in weights) or first_extra < 0 or last_extra < 0:
        raise PartitaError("block costs and the embedding/head extras must not be negative.")
    return _balanced(weights, n_stages, first_extra, last_extra)


def _greedy(
    weights: list[float], n_stages: int, first: float, last: float, cap: float
) -> list[int] | None:
    """Fill stages left to right up to `cap`; cut indices, or None if it does not fit."""
    n = len(weights)
    cuts = [0]
    load = first
    for i, w in enumerate(weights):
        stage = len(cuts) - 1
        blocks_left_after = n - i - 1
        stages_left_after = n_stages - stage - 1
        starts_stage = i == cuts[-1]
        # Close the stage before block i when it would overflow — or when the blocks that
        # remain are just enough to give every later stage one.
        if not starts_stage and (load + w > cap or blocks_left_after + 1 == stages_left_after):
            if stages_left_after == 0:
                return None
            cuts.append(i)
            load = 0.0
            stage += 1
        load += w
        if stage == n_stages - 1 and i == n - 1:
            load += last
        if load > cap:
            return None
    if len(cuts) != n_stages:
        return None
    return cuts + [n]


def _balanced(weights: list[float], n_stages: int, first: float, last: float) -> list[range]:
    lo = max(weights + [0.0])
    hi = sum(weights) + first + last
    best = _greedy(weights, n_stages, first, last, hi)
    for _ in range(100):  # bisection on the cap; 100 halvings is far below float resolution
        mid = (lo + hi) / 2
        cuts = _greedy(weights, n_stages, first, last, mid)
        if cuts is None:
            lo = mid
        else:
            best, hi = cuts, mid
        if hi - lo <= 1e-12 * max(hi, 1.0):
            break
    assert best is not None  # the cap `hi` always fits: one block per stage at most
    return [range(best[s], best[s + 1]) for s in range(n_stages)]
