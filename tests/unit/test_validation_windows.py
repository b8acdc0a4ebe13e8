"""Which windows validation evaluates: the same ones at every data-parallel size, padded
where a batch does not split evenly."""

from __future__ import annotations

import numpy as np
import pytest

from partita.data.sampler import IGNORE_INDEX, eval_batch_size, eval_batches

L = 4  # seq_len
TOKENS = np.arange(4 * 11 + 1, dtype=np.uint32)  # 11 windows; window w starts at token w*L


def _counted_windows(tokens: np.ndarray, batch: int, dp: int,
                     max_batches: int | None = None) -> list[list[int]]:
    """Per batch, the windows whose targets count, over all replicas in rank order."""
    per_rank = [list(eval_batches(tokens, L, batch, r, dp, max_batches)) for r in range(dp)]
    assert len({len(b) for b in per_rank}) == 1  # every replica runs as many batches
    out = []
    for b in range(len(per_rank[0])):
        shapes = {per_rank[r][b][0].shape for r in range(dp)}
        assert len(shapes) == 1, shapes  # and the same shapes, for the collectives
        windows = []
        for r in range(dp):
            x, y = per_rank[r][b]
            counted = (y != IGNORE_INDEX).any(dim=1)
            assert bool(((y == IGNORE_INDEX) == ~counted[:, None]).all())  # whole rows
            windows += (x[counted, 0] // L).tolist()
        out.append(windows)
    return out


@pytest.mark.parametrize("dp", [2, 4, 8])
@pytest.mark.parametrize("max_batches", [None, 1, 4])
def test_every_data_parallel_size_evaluates_the_same_windows(dp, max_batches):
    """11 windows with 8 per batch: a full batch and one of 3, which 2, 4 or 8 replicas
    cannot split evenly. The last 3 windows were left out at any size (a remainder
    smaller than the batch was dropped), and a split of fewer windows than the batch
    was refused; now each replica pads its rows with targets that count nothing."""
    one = _counted_windows(TOKENS, 8, 1, max_batches)
    want = list(range(min(11, 8 * (max_batches or 99))))
    assert sum(one, []) == want
    assert _counted_windows(TOKENS, 8, dp, max_batches) == one


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_a_split_smaller_than_the_batch_is_evaluated_whole(dp):
    """5 windows, global batch 8: every window at every size (at 2 replicas the batch
    size was cut to 4 windows, at 4 replicas to 4, at 1 it was 5)."""
    small = TOKENS[:5 * L + 1]
    assert eval_batch_size(len(small), 8) == 8
    assert _counted_windows(small, 8, dp) == [[0, 1, 2, 3, 4]]


def test_padding_rows_repeat_real_inputs_and_count_nothing():
    x, y = list(eval_batches(TOKENS[:3 * L + 1], L, 4, dp_rank=1, dp_size=2))[0]
    assert (x[:, 0] // L).tolist() == [2, 0]  # window 2, then the batch's first as padding
    assert (y[0] != IGNORE_INDEX).all() and (y[1] == IGNORE_INDEX).all()


def test_fewer_windows_than_replicas_are_evaluated_whole():
    """3 windows for 4 replicas was refused before launch (each replica needed one);
    the fourth replica now runs padding rows only."""
    assert _counted_windows(TOKENS[:3 * L + 1], 8, 4) == [[0, 1, 2]]



def test_a_short_batch_is_padded_to_a_multiple_of_the_pipeline_microbatches():
    """3 windows on one replica whose pipeline cuts batches into 2 microbatches: 4 rows
    (the 4th padding), not 3, which an interleaved schedule could not run; a full batch
    is unchanged."""
    full, short = list(eval_batches(TOKENS, L, 8, rows_multiple=2))
    assert full[0].shape[0] == 8 and short[0].shape[0] == 4
    assert (short[1][3] == IGNORE_INDEX).all() and (short[1][:3] != IGNORE_INDEX).all()
    per_rank = [list(eval_batches(TOKENS, L, 8, r, 2, rows_multiple=2))[1] for r in range(2)]
    assert [x.shape[0] for x, _ in per_rank] == [2, 2]  # 3 windows, 2 replicas: 2 rows each
