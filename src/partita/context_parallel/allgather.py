"""All-gather attention over the context-parallel group, as one autograd Function.

Every rank gathers the keys and values of the whole sequence once per layer (one
all-gather of the packed pair), then attends each of its query chunks to the key
prefix it may see. Backward gathers them again rather than keeping the whole sequence
between forward and backward (saved activations stay those of the local shard), and
returns key/value gradients to their owners with one reduce-scatter.

Keys and values travel packed in one tensor, through partita's own counted collectives;
the backward has a float64 gradient test of its own (tests/dist/test_context_parallel.py).
"""

from __future__ import annotations

import torch

from partita.comm import GroupComm
from partita.context_parallel import blocks
from partita.context_parallel.clock import IDLE
from partita.context_parallel.sharding import chunks_of


def _gather(kv: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    """(2, b, g, 2n, d) on each rank -> (c, 2, b, g, 2n, d) in rank order."""
    out = kv.new_empty((comm.size, *kv.shape))
    comm.all_gather_flat(out, kv.contiguous())
    return out


def _natural(gathered: torch.Tensor, n: int) -> torch.Tensor:
    """Rank-ordered shards -> (2, b, g, s, d) with the chunks in sequence order."""
    degree = gathered.shape[0]
    owner = {}
    for rank in range(degree):
        for half, chunk in enumerate(chunks_of(rank, degree)):
            owner[chunk] = (rank, half)
    return torch.cat([gathered[r][..., h * n:(h + 1) * n, :]
                      for r, h in (owner[j] for j in range(2 * degree))], dim=-2)


def _to_ranks(natural: torch.Tensor, degree: int, n: int) -> torch.Tensor:
    """The inverse of `_natural`: (2, b, g, s, d) -> (c, 2, b, g, 2n, d), contiguous."""
    pieces = natural.split(n, dim=-2)
    return torch.stack([torch.cat([pieces[j] for j in chunks_of(rank, degree)], dim=-2)
                        for rank in range(degree)])


class AllGatherAttention(torch.autograd.Function):
    """Causal attention of q (b, h, s, d) against k, v (b, g, s, d) sharded over `comm`."""

    @staticmethod
    def forward(ctx, q, k, v, comm: GroupComm, scale: float, segments=None, clock=IDLE):
        g, n = k.shape[1], q.shape[2] // 2
        full = _natural(_gather(torch.stack((k, v)), comm), n)
        qg = blocks.group_queries(q, g)
        outs, lses = [], []
        with clock.compute():
            for qi, chunk in enumerate(chunks_of(comm.index, comm.size)):
                keys = slice(0, (chunk + 1) * n)
                out, lse = blocks.forward(qg[..., qi * n:(qi + 1) * n, :], full[0][..., keys, :],
                                          full[1][..., keys, :], scale,
                                          _mask(segments, chunk, n, q.device))
                outs.append(out)
                lses.append(lse)
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.scale, ctx.segments, ctx.clock = comm, scale, segments, clock
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, scale = ctx.comm, ctx.scale
        g, n = k.shape[1], q.shape[2] // 2
        full = _natural(_gather(torch.stack((k, v)), comm), n)
        qg = blocks.group_queries(q, g)
        work = blocks.compute_dtype(q.dtype)
        dout = blocks.group_queries(grad_out.contiguous(), g).to(work)
        delta = (dout * out).sum(-1)
        dq = torch.empty(qg.shape, dtype=work, device=q.device)
        # Gradients accumulate (and are reduce-scattered) in the compute dtype.
        dfull = torch.zeros(full.shape, dtype=work, device=full.device)
        with ctx.clock.compute():
            for qi, chunk in enumerate(chunks_of(comm.index, comm.size)):
                rows, keys = slice(qi * n, (qi + 1) * n), slice(0, (chunk + 1) * n)
                dq[..., rows, :], dk, dv = blocks.backward(
                    qg[..., rows, :], full[0][..., keys, :], full[1][..., keys, :], scale,
                    _mask(ctx.segments, chunk, n, q.device), dout[..., rows, :],
                    lse[..., rows], delta[..., rows])
                dfull[0][..., keys, :] += dk
                dfull[1][..., keys, :] += dv
        mine = dfull.new_empty((2, *k.shape))
        comm.reduce_scatter_flat(mine, _to_ranks(dfull, comm.size, n))
        return (dq.reshape(q.shape).to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype),
                None, None, None, None)


def _mask(segments: torch.Tensor | None, chunk: int, n: int,
          device: torch.device) -> torch.Tensor | None:
    """What query chunk `chunk` hides of the key prefix it sees (positions 0..)."""
    return blocks.within_documents(blocks.causal_mask(n, (chunk + 1) * n, device), segments,
                                   chunk * n, n, 0, (chunk + 1) * n)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: GroupComm,
                        scale: float, segments: torch.Tensor | None = None,
                        clock=IDLE) -> torch.Tensor:
    """`segments` (b, s): documents of the whole packed sequence (None: one per row);
    `clock` (an `AttentionClock`) adds up the seconds spent computing pieces."""
    return AllGatherAttention.apply(q, k.contiguous(), v.contiguous(), comm, scale, segments,
                                    clock)
