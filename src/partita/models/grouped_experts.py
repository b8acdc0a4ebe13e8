"""Stacked SwiGLU experts run over row segments, with a hand-written backward.

The rows come as consecutive segments, each for one expert of the stack; an expert may
own several segments (under expert parallelism: one per sending rank). Autograd over
per-segment `F.linear` calls would give each segment its own weight-gradient matrices,
transposed ((x^T g)^T for a linear's weight), add them per expert and finally stack them
into the (E, ...) gradients: a strided copy of every expert's three matrices per step,
which measured as large as all the routing. Here each weight gradient is one matmul
written in place into its row of the stacked gradient (`out=`, then `addmm_` for an
expert's further segments), and the outputs and the input gradient are written into
their segments of one buffer, so there is no cat, no add and no stack.

Same arithmetic as the autograd version: h = silu(x Wg^T) * (x Wu^T), y = h Wd^T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, counts, experts):
        y = x.new_empty((x.shape[0], w_down.shape[1]))
        saved = []
        for part, out, e in zip(x.split(counts), y.split(counts), experts):
            g = torch.mm(part, w_gate[e].t())
            u = torch.mm(part, w_up[e].t())
            sg = F.silu(g)
            h = sg * u
            torch.mm(h, w_down[e].t(), out=out)
            saved += [g, u, sg, h]
        ctx.save_for_backward(x, w_gate, w_up, w_down, *saved)
        ctx.counts, ctx.experts = counts, experts
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, w_gate, w_up, w_down, *saved = ctx.saved_tensors
        counts, experts = ctx.counts, ctx.experts
        want_x = ctx.needs_input_grad[0]  # not when the tokens are leaves (a benchmark)
        grad_x = torch.empty_like(x) if want_x else None
        grads = [torch.empty_like(w) for w in (w_gate, w_up, w_down)]
        written: set[int] = set()
        grad_y = grad_y.contiguous()
        parts = zip(x.split(counts), grad_y.split(counts), experts)
        grad_xs = grad_x.split(counts) if want_x else [None] * len(counts)
        for i, ((part, gy, e), gx) in enumerate(zip(parts, grad_xs)):
            g, u, sg, h = saved[4 * i: 4 * i + 4]
            grad_h = torch.mm(gy, w_down[e])
            grad_u = grad_h * sg
            grad_g = torch.ops.aten.silu_backward(grad_h * u, g)
            if e in written:  # a further segment of this expert: accumulate in place
                grads[2][e].addmm_(gy.t(), h)
                grads[1][e].addmm_(grad_u.t(), part)
                grads[0][e].addmm_(grad_g.t(), part)
            else:
                torch.mm(gy.t(), h, out=grads[2][e])
                torch.mm(grad_u.t(), part, out=grads[1][e])
                torch.mm(grad_g.t(), part, out=grads[0][e])
                written.add(e)
            if want_x:
                torch.mm(grad_g, w_gate[e], out=gx)
                gx.addmm_(grad_u, w_up[e])
        for e in set(range(w_gate.shape[0])) - written:  # no segment: no gradient
            for grad in grads:
                grad[e].zero_()
        return grad_x, *grads, None, None


def grouped_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, counts: list[int], experts: list[int]
                   ) -> torch.Tensor:
    """Rows of `x` in segments (counts[i] rows for expert experts[i]) through their
    SwiGLU experts; w_gate, w_up (E, hidden, dim), w_down (E, dim, hidden)."""
    return _GroupedSwiGLU.apply(x, w_gate, w_up, w_down, counts, experts)
