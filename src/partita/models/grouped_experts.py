"""Stacked SwiGLU experts run over row segments, with a hand-written backward.

The rows come as consecutive segments, each for one expert of the stack; an expert may
own several segments (under expert parallelism: one per sending rank, as the rows
arrive). Each expert computes once over all its rows: its segments are joined (a copy
only when it has more than one), so that every matmul, the weight gradients' above all
(whose inner dimension is the rows), runs at full length. The down projection writes
its output straight into each segment's place, and the input gradient likewise, so the
caller's row order is kept with no scatter.

Autograd over per-expert `F.linear` calls would make each weight gradient a transposed
matrix ((x^T g)^T for a linear's weight) and then stack them into the (E, ...)
gradients: a strided copy of every expert's three matrices per step, which measured as
large as all of the routing. Here each weight gradient is one matmul written into its
row of the stacked gradient (`out=`). The input gradient is skipped when the rows need
none (tokens that are leaves, as in a benchmark).

Same arithmetic as the autograd version: h = silu(x Wg^T) * (x Wu^T), y = h Wd^T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _segments_of(counts: list[int], experts: list[int], n_experts: int
                 ) -> list[list[int]]:
    """For each expert, the indices of its segments in order."""
    owned: list[list[int]] = [[] for _ in range(n_experts)]
    for i, e in enumerate(experts):
        owned[e].append(i)
    return owned


def _join(parts: tuple[torch.Tensor, ...], idx: list[int]) -> torch.Tensor:
    return parts[idx[0]] if len(idx) == 1 else torch.cat([parts[i] for i in idx])


class _GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, counts, experts):
        owned = _segments_of(counts, experts, w_gate.shape[0])
        xs = x.split(counts)
        y = x.new_empty((x.shape[0], w_down.shape[1]))
        ys = y.split(counts)
        saved = []
        for e, idx in enumerate(owned):
            if not idx:
                continue
            rows = _join(xs, idx)
            g = torch.mm(rows, w_gate[e].t())
            u = torch.mm(rows, w_up[e].t())
            sg = F.silu(g)
            h = sg * u
            for i, hs in zip(idx, h.split([counts[i] for i in idx])):
                torch.mm(hs, w_down[e].t(), out=ys[i])
            saved += [rows, g, u, sg, h]
        ctx.save_for_backward(w_gate, w_up, w_down, *saved)
        ctx.counts, ctx.owned = counts, owned
        return y

    @staticmethod
    def backward(ctx, grad_y):
        w_gate, w_up, w_down, *saved = ctx.saved_tensors
        counts, owned = ctx.counts, ctx.owned
        want_x = ctx.needs_input_grad[0]
        grad_x = grad_y.new_empty((sum(counts), w_gate.shape[2])) if want_x else None
        gxs = grad_x.split(counts) if want_x else ()
        gys = grad_y.contiguous().split(counts)
        grads = [torch.empty_like(w) for w in (w_gate, w_up, w_down)]
        k = 0
        for e, idx in enumerate(owned):
            if not idx:  # no segment: no gradient
                for grad in grads:
                    grad[e].zero_()
                continue
            rows, g, u, sg, h = saved[5 * k: 5 * k + 5]
            k += 1
            gy = _join(gys, idx)
            grad_h = torch.mm(gy, w_down[e])
            grad_u = grad_h * sg
            grad_g = torch.ops.aten.silu_backward(grad_h.mul_(u), g)  # grad_h is spent
            torch.mm(gy.t(), h, out=grads[2][e])
            torch.mm(grad_u.t(), rows, out=grads[1][e])
            torch.mm(grad_g.t(), rows, out=grads[0][e])
            if want_x:
                sizes = [counts[i] for i in idx]
                for i, gg, gu in zip(idx, grad_g.split(sizes), grad_u.split(sizes)):
                    torch.mm(gg, w_gate[e], out=gxs[i])
                    gxs[i].addmm_(gu, w_up[e])
        return grad_x, *grads, None, None


def grouped_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, counts: list[int], experts: list[int]
                   ) -> torch.Tensor:
    """Rows of `x` in segments (counts[i] rows for expert experts[i]) through their
    SwiGLU experts; w_gate, w_up (E, hidden, dim), w_down (E, dim, hidden)."""
    return _GroupedSwiGLU.apply(x, w_gate, w_up, w_down, counts, experts)
