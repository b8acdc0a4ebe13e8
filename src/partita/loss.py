"""Next-token cross-entropy that keeps one fp32 tensor of tokens x vocabulary, not three.

torch's `F.cross_entropy` saves the log-probabilities for backward, and its backward
holds two more fp32 tensors of that size at once (the gradient of the log-probabilities
and of the logits): 12 bytes per logit at the peak. With a 128K vocabulary that was
8.4 GB of a 1.24B model's 47.9 GB on an H200 (docs/benchmarks.md, "On a GPU"). Here a 16-bit
input is copied up to fp32 once and everything else happens in that copy: shifted by
the row maximum, exponentiated in place and saved unnormalised with its row sums; the
backward turns it into the gradient in place (softmax minus one-hot, times the
incoming gradient over the counted tokens). Peak: the saved tensor plus the 16-bit
logits (forward) or their 16-bit gradient (backward), 6 bytes per bf16 logit; fp32
logits are not ours to overwrite, so the shifted copy is new, 8 bytes per logit. On
one CPU thread the forward and backward also take about half torch's time (2,048
tokens x 32,000 entries, median of 7 alternating runs: 201 against 413 ms in fp32, 308
against 644 ms in bf16); not yet timed on a GPU.

The same function computes the vocabulary-parallel loss: given a group, each rank
holds logits for vocabulary entries [vocab_start, vocab_start + width) and three
all-reduces of one number per token (row maximum, target logit, sum of exponentials)
make every rank's loss the loss over the whole vocabulary; the backward needs no
communication, because each rank's slice of the softmax is its slice of the gradient.

Small inputs on one rank (`FUSED_UP_TO` logits) go to torch's fused kernel instead:
there launching ops, not memory, sets the time, and its extra bytes are a few MB.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from partita.errors import PartitaError

# Up to this many logits (one rank's, one microbatch) torch's fused kernel computes the
# loss instead: there the time goes to launching ops, not to memory traffic, and ours
# calls 40 aten ops in forward and backward against torch's 3 fused ones (counted with
# torch.profiler). fp32, one thread, forward and backward, median of 400 alternating
# runs: 0.53 ms against torch's 0.27 at 256 tokens x 256 entries; 0.85 against 0.76 at
# 256 x 1,024, this bound; from 256 x 4,096 ours is faster, 3.8 against 6.3 ms. torch's
# 12 bytes per logit are at most 3 MB here.
FUSED_UP_TO = 1 << 18


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, comm, vocab_start, vocab_size, ignore_index):
        # At least fp32: bf16 exponentials and sums lose the loss's precision.
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        owned = x is not logits  # a copy of ours: work on it in place
        real = max(0, min(vocab_size - vocab_start, x.shape[-1]))
        if real < x.shape[-1]:  # padding columns: no probability mass, whatever they hold
            x = x if owned else x.clone()
            owned = True
            x[..., real:] = float("-inf")
        x_max = x.amax(dim=-1, keepdim=True)
        if comm is not None:
            comm.all_reduce(x_max, op=dist.ReduceOp.MAX)  # 1
        x = x.sub_(x_max) if owned else x - x_max

        local_target = targets - vocab_start
        here = (local_target >= 0) & (local_target < real)
        index = local_target.masked_fill(~here, 0).unsqueeze(-1)
        target_logit = x.gather(-1, index).squeeze(-1).masked_fill(~here, 0.0)
        exp = x.exp_()
        sum_exp = exp.sum(dim=-1)
        if comm is not None:
            comm.all_reduce(target_logit)  # 2
            comm.all_reduce(sum_exp)  # 3

        counted = targets != ignore_index
        n = counted.sum().clamp(min=1)
        loss = ((sum_exp.log() - target_logit) * counted).sum() / n
        ctx.save_for_backward(exp, sum_exp, here, index, counted, n)
        ctx.out_dtype = logits.dtype
        return loss  # in the computation dtype (fp32 for bf16 logits), as loss scaling wants

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, here, index, counted, n = ctx.saved_tensors
        scale = counted.to(exp.dtype) * (grad_loss / n)  # per token
        grad = exp.mul_((scale / sum_exp).unsqueeze(-1))  # softmax x scale, in place
        grad.scatter_add_(-1, index, -(here.to(exp.dtype) * scale).unsqueeze(-1))
        return grad.to(ctx.out_dtype), None, None, None, None, None


def _fused_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int) -> torch.Tensor:
    """The same loss through `F.cross_entropy` (small inputs, see FUSED_UP_TO): at least
    fp32, and 0 rather than NaN when no token counts, as `_CrossEntropy` gives."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    total = F.cross_entropy(x, targets, ignore_index=ignore_index, reduction="sum")
    return total / (targets != ignore_index).sum().clamp(min=1)


def check_microbatches(rows: int, microbatches: int) -> None:
    """Refuse a microbatch count that does not cut `rows` into equal microbatches: each
    microbatch's loss is weighted 1 / microbatches, so fewer or unequal chunks (what
    `Tensor.chunk` gives then) would scale the loss and gradients wrongly."""
    if microbatches < 1 or rows % microbatches:
        raise PartitaError(
            f"{microbatches} microbatches do not divide this rank's batch of {rows} rows "
            "into equal microbatches, so their losses could not be weighted alike. Pass "
            f"a number of microbatches that divides {rows} (as train.microbatches must "
            "divide each replica's rows), or a batch whose rows it divides.")


def microbatch_weight(targets: torch.Tensor, microbatches: int,
                      targets_per_rank: float | None, ignore_index: int = -100) -> float:
    """The factor on one microbatch's mean loss that makes a step's loss the mean over
    all of the step's trained targets, however many of them each rank and microbatch
    holds (targets equal to `ignore_index` are not trained: a document's start).

    Runners divide each microbatch's mean by the number of microbatches and data
    parallelism averages the ranks' results; both assume equal counts. Weighted by
    (trained targets here) x microbatches / `targets_per_rank` (the step's trained
    targets over the ranks the loss is averaged on), the sum of sums over the total
    comes out instead. 1 when every target is trained; None: no weighting.
    """
    if targets_per_rank is None:
        return 1.0
    return int((targets != ignore_index).sum()) * microbatches / targets_per_rank


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm=None,
                  vocab_start: int = 0, vocab_size: int | None = None,
                  ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over the counted tokens (targets not equal to `ignore_index`).

    `logits` (..., width) and `targets` (...) of global token ids. Without `comm` the
    logits cover the whole vocabulary and this equals `F.cross_entropy(logits.flatten(0,
    -2), targets.flatten(), ignore_index=ignore_index)`. With a `GroupComm`, column j is
    the logit of token `vocab_start + j` on this rank and the result is the loss over the
    vocabulary of all ranks; columns at or past `vocab_size` (padding) are ignored.
    """
    width = logits.shape[-1]
    if comm is None and vocab_start == 0 and logits.numel() <= FUSED_UP_TO:
        if vocab_size is not None and vocab_size < width:
            # A padded vocabulary (model.vocab_multiple): its extra columns are no token.
            logits, width = logits[..., :vocab_size], vocab_size
        return _fused_cross_entropy(logits.reshape(-1, width), targets.reshape(-1),
                                    ignore_index)
    return _CrossEntropy.apply(logits.reshape(-1, width), targets.reshape(-1), comm,
                               vocab_start, width if vocab_size is None else vocab_size,
                               ignore_index)
