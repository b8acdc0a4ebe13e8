"""Tied input/output embeddings split between the first and the last pipeline stage.

The first stage owns the embedding matrix (a parameter: optimizer state, gradient
norm, checkpoint). The last stage holds a plain-tensor copy for its output head. The
two stay identical because, every step:

1. the first stage sends its current weight (right after its first embedding forward,
   when any overlapped all-gather of the updated weight has completed) and the last
   stage receives it into the copy before its first head forward;
2. the last stage sends the head's gradient (summed over microbatches) right after its
   last backward, and the first stage adds it to the embedding gradient inside its own
   last backward (`extra_root`), so the gradient reaches `.grad` in one accumulation and
   the data-parallel engine reduces the combined gradient once.

Both transfers run on the "embedding" group (the first and last stage of each data /
tensor-parallel position), so they never reorder the pipeline's own transfers. The
last stage's final backward precedes the first stage's in every schedule, so waiting
for the gradient cannot deadlock. On one host they go through shared-memory rings
(`partita.shm_channel`), as the pipeline's own transfers do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.comm import GroupComm
from partita.pipeline.p2p import PipelineTimeout
from partita.shm_channel import open_channels


class TiedHead:
    """This rank's side of the exchange: `owner` (first stage) or `copy` (last stage)."""

    def __init__(self, comm: GroupComm, weight: torch.Tensor, owner: bool,
                 timeout_s: float) -> None:
        self.comm = comm
        self.weight = weight  # the embedding parameter, or the head's copy (a leaf)
        self.owner = owner
        self.peer = comm.ranks[1] if owner else comm.ranks[0]
        self.timeout_s = timeout_s
        self._weight_work = None
        self._grad_work = None
        self._grad_buf: torch.Tensor | None = None
        self._sends: list[tuple[object, torch.Tensor]] = []
        self._weight_sent = False
        # As the pipeline's Transport decides (collective over the two ranks).
        self.rings = open_channels(comm, [(0, 1), (1, 0)], timeout_s, "tied-embedding")

    def begin(self, want_grad: bool) -> None:
        """Start of a step (or evaluation): the copy posts its receive of the weight;
        when training, the owner posts its receive of the head gradient."""
        self._weight_sent = False
        if self.owner:
            if want_grad:
                self._grad_buf = torch.empty_like(self.weight.detach())
                self._grad_work = self._post(False, self._grad_buf)
        else:
            self._weight_work = self._post(False, self.weight.detach())

    def send_weight(self) -> None:
        """The owner, right after its first embedding forward of the step: by then the
        data-parallel engine has finished any all-gather of the updated weight (its
        forward pre-hook waits for it), so the copy gets this step's values."""
        if self.owner and not self._weight_sent:
            w = self.weight.detach()
            self._sends.append((self._post(True, w), w))
            self._weight_sent = True

    def wait_weight(self) -> None:
        """The copy, before its first forward."""
        if self._weight_work is not None:
            self._wait(self._weight_work, "the embedding weight for the tied output head")
            self._weight_work = None

    def send_grad(self) -> None:
        """The copy, after its last backward of the step: hand the gradient over."""
        grad = self.weight.grad
        if grad is None:
            grad = torch.zeros_like(self.weight)
        self.weight.grad = None
        self._sends.append((self._post(True, grad), grad))

    def extra_root(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The owner, inside its last backward: (embedding weight, head gradient) to pass
        to autograd as one more root, so both gradients accumulate together."""
        self._wait(self._grad_work, "the tied output head's gradient")
        grad, self._grad_buf, self._grad_work = self._grad_buf, None, None
        return self.weight, grad

    def finish(self) -> None:
        for work, _ in self._sends:
            self._wait(work, "delivery of a tied-embedding transfer")
        self._sends.clear()

    def _post(self, send: bool, tensor: torch.Tensor):
        if self.rings is not None:
            peer = 1 - self.comm.index
            return (self.rings.send if send else self.rings.recv)(peer, tensor)
        (work,) = dist.batch_isend_irecv([self.comm.p2p_op(send, tensor, self.peer)])
        return work

    def _wait(self, work, what: str) -> None:
        import datetime

        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            side = "first" if self.owner else "last"
            raise PipelineTimeout(
                f"rank {dist.get_rank()} ({side} pipeline stage) waited {self.timeout_s:g} s "
                f"for {what} from rank {self.peer}, which did not answer: it probably died "
                f"or stalls. (cause: {exc})"
            ) from exc
