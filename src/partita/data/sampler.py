"""Deterministic, resumable batches of token windows for data-parallel training.

Windows. The token stream is cut into windows of seq_len + 1 tokens with stride
seq_len: window w covers tokens[w*L : w*L + L + 1], inputs are its first L tokens and
targets its last L. Consecutive windows share one token (the last target of window w
is the first input of window w+1), so over all windows every next-token pair of the
stream is trained exactly once: none skipped, none repeated.

Epochs. Epoch e visits the windows in a permutation seeded by (seed, e). Each step
takes the next *global batch* of G windows from it. When G does not divide the number
of windows, the last (num_windows mod G) windows of the permutation are dropped for
that epoch, and the next epoch reshuffles; with a fresh permutation each epoch a
different remainder is dropped, so nothing is systematically left out.

Data parallelism. Replica r of D receives rows [r*G/D, (r+1)*G/D) of the global batch.
The global batch depends only on (seed, epoch, step), never on D, so a run can resume
with another data-parallel size and still see the same global batches. Ranks of one
replica (tensor, pipeline, context peers) pass the same dp_rank and get the same tokens.

Resumption. The state is (epoch, step); `state_dict`/`load_state_dict` restore it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from partita.errors import AgreedError, PartitaError
from partita.models.documents import starts_documents

if TYPE_CHECKING:
    import torch

# torch is imported where batches are made, not with the module: tokenizer worker
# processes import this package and need none of it (it takes seconds to import).
Batch = tuple["torch.Tensor", "torch.Tensor"]


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many windows of seq_len + 1 tokens, stride seq_len, fit in num_tokens."""
    return max(0, (num_tokens - 1) // seq_len)


IGNORE_INDEX = -100  # partita.loss.cross_entropy's default: such targets are not trained


def windows_to_batch(tokens: np.ndarray, windows: np.ndarray, seq_len: int,
                     boundary: int | None = None) -> Batch:
    """(inputs, targets) int64 tensors of shape (len(windows), seq_len).

    With `boundary` an end-of-document token, a target whose input is that token --
    the first token of the next packed document -- becomes IGNORE_INDEX: the loss never
    asks the model to predict one document from another. A start token
    (`partita.models.documents.DocumentStart`) masks nothing: the document before it
    learns to end by predicting it, and the first token after it is predicted from it
    alone, as from a BOS.
    """
    import torch

    offsets = np.asarray(windows, dtype=np.int64)[:, None] * seq_len + np.arange(seq_len + 1)
    # Fancy indexing a memmap reads only the pages touched and returns a private copy.
    block = np.asarray(tokens[offsets], dtype=np.int64)
    inputs, targets = block[:, :-1].copy(), block[:, 1:].copy()
    if boundary is not None and not starts_documents(boundary):
        targets[inputs == boundary] = IGNORE_INDEX
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def _check_layout(global_batch: int, dp_rank: int, dp_size: int) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise PartitaError(f"dp_rank must be in [0, dp_size) with dp_size >= 1, got dp_rank "
                           f"{dp_rank} and dp_size {dp_size}.")
    if global_batch < 1 or global_batch % dp_size:
        raise PartitaError(f"The global batch of {global_batch} sequences cannot be split "
                           f"evenly over {dp_size} data-parallel replicas. Choose a global "
                           f"batch that is a positive multiple of {dp_size}.")


class BatchSampler:
    """Training batches for one data-parallel replica; iterate it or call `next(...)`."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 boundary: int | None = None) -> None:
        _check_layout(global_batch, dp_rank, dp_size)
        self.tokens = tokens
        self.boundary = boundary  # end-of-document token (see windows_to_batch)
        self.seq_len = int(seq_len)
        self.global_batch = int(global_batch)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.seed = int(seed)
        self.num_windows = num_windows(len(tokens), self.seq_len)
        self.steps_per_epoch = self.num_windows // self.global_batch
        if self.steps_per_epoch == 0:
            # Every replica finds this from the same tokens: one report, not one per rank.
            raise AgreedError(too_few_windows(len(tokens), self.seq_len, self.global_batch))
        self.epoch = 0
        self.step = 0
        self._perm: tuple[int, np.ndarray] | None = None

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    def permutation(self, epoch: int) -> np.ndarray:
        """The window order of `epoch` (cached for the current epoch)."""
        if self._perm is None or self._perm[0] != epoch:
            # Sort raw 64-bit draws rather than call Generator.permutation: numpy
            # guarantees the bit stream of PCG64 + SeedSequence across versions, not
            # the algorithms built on it, and a resumed run must see the same order.
            bits = np.random.PCG64(np.random.SeedSequence([self.seed, epoch]))
            keys = bits.random_raw(self.num_windows)
            self._perm = (epoch, np.argsort(keys, kind="stable"))
        return self._perm[1]

    def global_windows(self, epoch: int, step: int) -> np.ndarray:
        """Window indices of the whole global batch at (epoch, step), all replicas."""
        if not 0 <= step < self.steps_per_epoch or epoch < 0:
            raise IndexError(f"step {step} outside epoch of {self.steps_per_epoch} steps")
        start = step * self.global_batch
        return self.permutation(epoch)[start: start + self.global_batch]

    def batch(self, epoch: int, step: int) -> Batch:
        """This replica's (inputs, targets) at (epoch, step), shape (G/D, seq_len)."""
        rows = self.global_windows(epoch, step)
        lo = self.dp_rank * self.local_batch
        return windows_to_batch(self.tokens, rows[lo: lo + self.local_batch], self.seq_len,
                                self.boundary)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        """The batch at the current position, then advance (endless: epochs roll over)."""
        out = self.batch(self.epoch, self.step)
        self.step += 1
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        """Position plus what must match on resume; dp_rank/dp_size are not state."""
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed,
                "seq_len": self.seq_len, "global_batch": self.global_batch,
                "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved position; the data-parallel size may differ."""
        check_resumable(state, {key: getattr(self, key) for key in
                                ("seed", "seq_len", "global_batch", "num_windows")})
        if not 0 <= state["step"] < self.steps_per_epoch or state["epoch"] < 0:
            raise PartitaError(f"corrupt sampler state {state}: step must be in [0, "
                               f"{self.steps_per_epoch}). Start a fresh run or use another "
                               "checkpoint.")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


def too_few_windows(num_tokens: int, seq_len: int, global_batch: int) -> str | None:
    """Why `num_tokens` training tokens cannot fill one global batch (None: they can)."""
    windows = num_windows(num_tokens, seq_len)
    if windows >= global_batch:
        return None
    return (f"the training data has {num_tokens:,} tokens, which make {windows:,} windows "
            f"of seq_len {seq_len}: fewer than one global batch of {global_batch:,}. Use more "
            f"data, a shorter data.seq_len or a train.global_batch of at most "
            f"{max(windows, 1):,}.")


def eval_batch_size(num_tokens: int, global_batch: int) -> int:
    """Windows per evaluation batch: the global batch (a small split's one batch holds
    fewer, see `eval_batches`), at any number of replicas, since a replica with fewer
    windows than the others pads its rows with ones that count nothing; 0 when there
    is no split."""
    return 0 if num_tokens == 0 else global_batch


def eval_batches(tokens: np.ndarray, seq_len: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, max_batches: int | None = None,
                 boundary: int | None = None, rows_multiple: int = 1) -> Iterator[Batch]:
    """Fixed evaluation batches over the first min(windows, max_batches x G) windows of
    `tokens`, in order, G per batch (the last batch holds the rest), each split by
    replica like a training batch. Empty when `tokens` make no window. (A mixture's
    validation part interleaves its sources, so these first windows cover every
    source: partita.data.mix.)

    The windows evaluated depend only on the split, G and `max_batches`, never on the
    number of replicas: a batch of n windows gives each replica ceil(n / D) rows, and a
    replica left with fewer real windows fills its rows with padding whose targets are
    all IGNORE_INDEX. A loss weighted by counted targets (as the trainer's validation
    is) then takes nothing from the padding, and every replica runs the same shapes,
    so collectives inside the forward (ZeRO-3 gathers, pipeline transfers) match.
    `rows_multiple` rounds a short batch's rows up to a multiple of it, with padding
    too (a pipeline evaluates a batch in its microbatches only when they divide it)."""
    _check_layout(global_batch, dp_rank, dp_size)
    used = num_windows(len(tokens), seq_len)
    if max_batches is not None:
        used = min(used, max_batches * global_batch)

    def generate() -> Iterator[Batch]:
        for lo in range(0, used, global_batch):
            n = min(global_batch, used - lo)
            rows = -(-n // (dp_size * rows_multiple)) * rows_multiple
            start = min(lo + dp_rank * rows, lo + n)
            real = np.arange(start, min(start + rows, lo + n))
            # Padding rows repeat the batch's first window as inputs (any real tokens
            # would do) and count no target.
            padded = np.concatenate([real, np.full(rows - len(real), lo)])
            inputs, targets = windows_to_batch(tokens, padded, seq_len, boundary)
            targets[len(real):] = IGNORE_INDEX
            yield inputs, targets

    return generate()


def check_resumable(state: dict, run: dict) -> None:
    """A checkpoint's sampler `state` continues in a run whose sampler has the values of
    `run` (any of seed, seq_len, global_batch, num_windows): the launcher checks those
    it knows before any process starts, the sampler all of them."""
    for key, value in run.items():
        if state.get(key, value) != value:
            raise PartitaError(f"cannot resume the data sampler: the checkpoint has "
                               f"{key}={state[key]} but this run has {key}={value}. Resume "
                               "with the same data, seed, seq_len and global batch as the "
                               "checkpointed run (the data-parallel size may change), or "
                               "start a fresh run.")
