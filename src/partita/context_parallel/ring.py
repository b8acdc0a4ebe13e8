"""Ring attention over the context-parallel group, as one autograd Function.

Each rank holds two chunks of queries, keys and values (see `sharding`). Forward: for
c steps, the rank attends its query chunks to the key/value chunks it holds, while the
next pair travels: it sends what it holds to the next rank and receives the previous
rank's, posted before the step's compute and waited after it. Pieces merge by the
log-sum-exp rule (`blocks.merge`); a key chunk entirely in a query chunk's future is
skipped, a chunk at the same position is masked causally.

Backward: keys and values go round the ring once more, each with an accumulator of its
own gradient. A rank adds its queries' contribution to the accumulator of the pair it
holds and passes the accumulator on with the pair; after c steps one last hop brings
every accumulator home. Forward keeps nothing it received, so saved activations are
those of the local shard only.

Only the kv heads travel: under grouped-query attention the queries are grouped by kv
head (`blocks.group_queries`) and a kv head is never repeated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.comm import GroupComm
from partita.context_parallel import blocks
from partita.context_parallel.clock import IDLE
from partita.context_parallel.sharding import chunks_of


class RingExchange:
    """Send tensors to the next rank of the group and receive as many from the previous."""

    def __init__(self, comm: GroupComm) -> None:
        self.comm = comm
        i, n = comm.index, comm.size
        self.next, self.prev = comm.ranks[(i + 1) % n], comm.ranks[(i - 1) % n]

    def start(self, tensors: list[torch.Tensor]) -> _Pending:
        received = [torch.empty_like(t) for t in tensors]
        ops = [self.comm.p2p_op(True, t, self.next) for t in tensors]
        ops += [self.comm.p2p_op(False, r, self.prev) for r in received]
        return _Pending(dist.batch_isend_irecv(ops) if ops else [], received, tensors)


class _Pending:
    def __init__(self, works: list, received: list[torch.Tensor],
                 sent: list[torch.Tensor]) -> None:
        self.works, self.received, self.sent = works, received, sent

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.sent = []  # the sent tensors may be freed only now
        return self.received


def _pairs(rank: int, src: int, degree: int):
    """(query half, key half, causal) for every piece rank computes against src's pair."""
    for qi, q_chunk in enumerate(chunks_of(rank, degree)):
        for kj, k_chunk in enumerate(chunks_of(src, degree)):
            if k_chunk <= q_chunk:
                yield qi, kj, k_chunk == q_chunk


class RingAttention(torch.autograd.Function):
    """Causal attention of q (b, h, s, d) against k, v (b, g, s, d) sharded over `comm`."""

    @staticmethod
    def forward(ctx, q, k, v, comm: GroupComm, scale: float, segments=None, clock=IDLE):
        g, n = k.shape[1], q.shape[2] // 2
        rank, degree = comm.index, comm.size
        mine = chunks_of(rank, degree)
        qg = blocks.group_queries(q, g)
        halves = (qg[..., :n, :], qg[..., n:, :])
        mask = blocks.causal_mask(n, n, q.device)
        outs: list = [None, None]
        lses: list = [None, None]
        ring = RingExchange(comm)
        kv = torch.stack((k, v))
        for step in range(degree):
            pending = ring.start([kv]) if step < degree - 1 else None
            src = (rank - step) % degree
            with clock.compute():
                for qi, kj, causal in _pairs(rank, src, degree):
                    piece = slice(kj * n, (kj + 1) * n)
                    out, lse = blocks.forward(halves[qi], kv[0][..., piece, :],
                                              kv[1][..., piece, :], scale,
                                              _mask(mask, causal, segments, mine[qi],
                                                    chunks_of(src, degree)[kj], n))
                    outs[qi], lses[qi] = blocks.merge(outs[qi], lses[qi], out, lse)
            if pending is not None:
                (kv,) = pending.wait()
        out = torch.cat(outs, dim=-2)
        lse = torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.scale, ctx.segments, ctx.clock = comm, scale, segments, clock
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, scale, segments, clock = ctx.comm, ctx.scale, ctx.segments, ctx.clock
        g, n = k.shape[1], q.shape[2] // 2
        rank, degree = comm.index, comm.size
        mine = chunks_of(rank, degree)
        qg = blocks.group_queries(q, g)
        work = blocks.compute_dtype(q.dtype)
        dout = blocks.group_queries(grad_out.contiguous(), g).to(work)
        delta = (dout * out).sum(-1)
        mask = blocks.causal_mask(n, n, q.device)
        dq = torch.zeros(qg.shape, dtype=work, device=q.device)
        halves = [slice(0, n), slice(n, 2 * n)]
        ring = RingExchange(comm)
        kv, acc = torch.stack((k, v)), None
        for step in range(degree):
            sends = ([kv] if step < degree - 1 else []) + ([acc] if acc is not None else [])
            pending = ring.start(sends)
            src = (rank - step) % degree
            # Gradients accumulate (and travel) in the compute dtype.
            local = torch.zeros(kv.shape, dtype=work, device=kv.device)
            with clock.compute():
                for qi, kj, causal in _pairs(rank, src, degree):
                    rows, piece = halves[qi], halves[kj]
                    dq_part, dk, dv = blocks.backward(
                        qg[..., rows, :], kv[0][..., piece, :], kv[1][..., piece, :], scale,
                        _mask(mask, causal, segments, mine[qi], chunks_of(src, degree)[kj], n),
                        dout[..., rows, :], lse[..., rows], delta[..., rows])
                    dq[..., rows, :] += dq_part
                    local[0][..., piece, :] += dk
                    local[1][..., piece, :] += dv
            received = pending.wait()
            if acc is not None:  # the accumulator of the pair held at this step
                local += received[-1]
            acc = local
            if step < degree - 1:
                kv = received[0]
        (acc,) = ring.start([acc]).wait()  # home: the accumulator of this rank's own pair
        return (dq.reshape(q.shape).to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype),
                None, None, None, None)


def _mask(causal_mask: torch.Tensor, causal: bool, segments: torch.Tensor | None,
          q_chunk: int, k_chunk: int, n: int) -> torch.Tensor | None:
    """What a piece of query chunk q_chunk against key chunk k_chunk hides."""
    return blocks.within_documents(causal_mask if causal else None, segments,
                                   q_chunk * n, n, k_chunk * n, n)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: GroupComm,
                   scale: float, segments: torch.Tensor | None = None,
                   clock=IDLE) -> torch.Tensor:
    """`segments` (b, s): documents of the whole packed sequence (None: one per row);
    `clock` (an `AttentionClock`) adds up the seconds spent computing pieces."""
    return RingAttention.apply(q, k.contiguous(), v.contiguous(), comm, scale, segments,
                               clock)
