"""Attention of one block of queries against one block of keys, with its log-sum-exp.

Both context-parallel kinds compute attention piecewise: a query chunk against the key
chunks it may see, one at a time (ring) or at once (all-gather). Each piece returns its
normalised output and the log-sum-exp of its scores, and pieces merge exactly:

    lse = logaddexp(lse_a, lse_b),  out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse).

The backward of a piece needs only the final output and log-sum-exp (flash attention's
rule), so no piece's probabilities are kept between forward and backward. Pieces run
torch's fused flash kernel where it exists (CPU) and no document mask applies.

Grouped-query attention: queries are (b, g, r, s, d) for g kv heads of r query heads
each, keys and values (b, g, s, d); a kv head is never repeated in memory.

Pieces compute in at least float32 (`compute_dtype`): 16-bit scores and log-sum-exps
would lose the precision the merges rely on. What travels keeps the model's dtype.
"""

from __future__ import annotations

import torch

from partita.context_parallel.sharding import positions


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """True where a query may not see a key, for a diagonal block whose last query and
    last key are the same position (the keys may start earlier)."""
    q_pos = torch.arange(q_len, device=device) + (k_len - q_len)
    return torch.arange(k_len, device=device)[None, :] > q_pos[:, None]


def document_mask(segments: torch.Tensor | None, q_positions: torch.Tensor,
                  k_positions: torch.Tensor) -> torch.Tensor | None:
    """True where a query may not see a key of another document, for queries and keys at
    the given sequence positions of packed rows whose documents `segments` (b, s: the
    whole sequence) numbers; None: one document a row."""
    if segments is None:
        return None
    sq, sk = segments[:, q_positions], segments[:, k_positions]
    return (sq[:, :, None] != sk[:, None, :])[:, None, None]  # (b, 1, 1, sq, sk)


def pair_documents(segments: torch.Tensor | None, rank: int, src: int, degree: int,
                   rows: slice, keys: slice) -> torch.Tensor | None:
    """`document_mask` of `rank`'s local query `rows` against `keys` of the pair `src`
    holds (local rows of the load-balanced shards)."""
    if segments is None:
        return None
    local = segments.shape[1] // degree  # segments number the whole sequence
    return document_mask(segments, positions(rank, degree, local)[rows],
                         positions(src, degree, local)[keys])


def _hidden(q_len: int, k_len: int, causal: bool, documents: torch.Tensor | None,
            device: torch.device) -> torch.Tensor | None:
    mask = causal_mask(q_len, k_len, device) if causal else None
    if documents is None:
        return mask
    return documents if mask is None else documents | mask


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a query that sees no key of a piece) as 0, to subtract safely."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


# A piece with no document mask runs torch's fused flash kernel where one exists that
# returns the log-sum-exp (CPU); it never materialises the scores, which is what lets
# a rank's share of attention keep pace with one process running the whole sequence.
# Elsewhere (and with document masks) the pieces compute the scores explicitly.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten,
                              "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fused(q: torch.Tensor, documents: torch.Tensor | None) -> bool:
    return documents is None and q.device.type == "cpu" and _CPU_FLASH_BACKWARD is not None


def _heads(q: torch.Tensor) -> torch.Tensor:
    """Grouped q (b, g, r, sq, d) -> (b, g*r, sq, d): the fused kernel reads query head
    i's kv head i // r from k, v (b, g, sk, d) in place, so no kv head is repeated."""
    b, g, r, sq, d = q.shape
    return q.reshape(b, g * r, sq, d)


def _flash_forward(q, k, v, scale: float, causal: bool):
    b, g, r, sq, d = q.shape
    out, lse = _CPU_FLASH(_heads(q), k, v, 0.0, causal, scale=scale)
    return out.reshape(q.shape), lse.reshape(b, g, r, sq)


def _flash_backward(q, k, v, scale: float, causal: bool, grad_out, out, lse):
    b, g, r, sq, d = q.shape
    qf = _heads(q)
    dq, dk, dv = _CPU_FLASH_BACKWARD(grad_out.reshape(qf.shape), qf, k, v,
                                     out.reshape(qf.shape), lse.reshape(b, g * r, sq),
                                     0.0, causal, scale=scale)
    return dq.reshape(q.shape), dk, dv


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
            documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q (b, g, r, sq, d) against k, v (b, g, sk, d). `causal`: the last
    query and the last key are the same position (the keys may start earlier);
    `documents`: what `document_mask` hides besides."""
    work = compute_dtype(q.dtype)
    q, k, v = q.to(work), k.to(work), v.to(work)
    sq, sk = q.shape[-2], k.shape[-2]
    if _fused(q, documents):
        if not causal or sk == sq:
            return _flash_forward(q, k, v, scale, causal)
        # Keys before the queries' first position are all visible: one plain piece for
        # them and one causal square, merged.
        p = sk - sq
        out, lse = _flash_forward(q, k[..., :p, :], v[..., :p, :], scale, False)
        return merge(out, lse, *_flash_forward(q, k[..., p:, :], v[..., p:, :], scale, True))
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    mask = _hidden(sq, sk, causal, documents, q.device)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # A query whose document has no key in this piece: lse -inf, output 0, and the merge
    # gives the piece no weight.
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return torch.matmul(probs, v.unsqueeze(2)), lse


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, part_out: torch.Tensor,
          part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine a running (out, lse) with one more piece (None: the first piece)."""
    if out is None or lse is None:
        return part_out, part_lse
    new_lse = torch.logaddexp(lse, part_lse)
    ref = _finite(new_lse)
    out = (out * torch.exp(lse - ref).unsqueeze(-1)
           + part_out * torch.exp(part_lse - ref).unsqueeze(-1))
    return out, new_lse


def merge_rows(out, lse, part_out, part_lse, rows: slice):
    """Merge a piece that covers `rows` of the local queries into the running (out, lse)
    of all of them (None before step 0, whose piece covers every row)."""
    if out is None:
        return part_out, part_lse
    out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows],
                                                     part_out, part_lse)
    return out, lse


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
             documents: torch.Tensor | None, grad_out: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one piece, given the final (merged) output and lse of its queries:
    flash attention's rule, with delta = rowsum(dO * O) of the final output."""
    work = compute_dtype(q.dtype)
    q, k, v, grad_out = q.to(work), k.to(work), v.to(work), grad_out.to(work)
    sq, sk = q.shape[-2], k.shape[-2]
    if _fused(q, documents):
        if not causal or sk == sq:
            return _flash_backward(q, k, v, scale, causal, grad_out, out, lse)
        p = sk - sq
        dq, dk, dv = _flash_backward(q, k[..., :p, :], v[..., :p, :], scale, False,
                                     grad_out, out, lse)
        dq2, dk2, dv2 = _flash_backward(q, k[..., p:, :], v[..., p:, :], scale, True,
                                        grad_out, out, lse)
        return dq + dq2, torch.cat((dk, dk2), dim=-2), torch.cat((dv, dv2), dim=-2)
    delta = (grad_out * out).sum(-1)
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    mask = _hidden(sq, sk, causal, documents, q.device)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), grad_out).sum(dim=2)
    dprobs = torch.matmul(grad_out, v.unsqueeze(2).transpose(-1, -2))
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    dq = torch.matmul(dscores, k.unsqueeze(2))
    dk = torch.matmul(dscores.transpose(-1, -2), q).sum(dim=2)
    return dq, dk, dv


class QueryGradients:
    """A core's backward over its queries, which both kinds run the same way: the saved
    query shard grouped by kv head, with its final output, log-sum-exp and incoming
    gradient, and dq summed over the pieces in the compute dtype (`work`)."""

    def __init__(self, q: torch.Tensor, kv_heads: int, out: torch.Tensor, lse: torch.Tensor,
                 grad_out: torch.Tensor, scale: float) -> None:
        self.q_shape, self.q_dtype, self.scale = q.shape, q.dtype, scale
        self.work = compute_dtype(q.dtype)
        self.qg = group_queries(q, kv_heads)
        self.out, self.lse = group_queries(out, kv_heads), lse
        self.dout = group_queries(grad_out.contiguous(), kv_heads).to(self.work)
        self.dq = torch.zeros(self.qg.shape, dtype=self.work, device=q.device)

    def piece(self, k: torch.Tensor, v: torch.Tensor, rows: slice, causal: bool,
              documents: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(dk, dv) of the query rows `rows` against the key block k, v; their dq is
        added to the sum."""
        dq, dk, dv = backward(self.qg[..., rows, :], k, v, self.scale, causal, documents,
                              self.dout[..., rows, :], self.out[..., rows, :],
                              self.lse[..., rows])
        self.dq[..., rows, :] += dq
        return dk, dv

    def result(self) -> torch.Tensor:
        """dq in the queries' shape and dtype."""
        return self.dq.reshape(self.q_shape).to(self.q_dtype)


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, h, s, d) -> (b, g, h/g, s, d): query heads grouped by the kv head they read."""
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, s, d)


def merged_output(out: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(returned, saved) for a core's merged output `out` (b, g, r, s, d), in the compute
    dtype. The returned tensor has q's shape (b, h, s, d) and dtype and lies in memory as
    (b, s, h, d), as one process's flash output does, so the model's head merge before
    the output projection is a view of it; where the compute dtype is q's, it is also
    the tensor saved for backward: one storage for both, as in one process (16-bit
    models save the fp32 output beside it). `saved` is (b, h, s, d) either way."""
    b, h, s, d = q.shape
    merged = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device)
    merged.copy_(out.reshape(q.shape).transpose(1, 2))
    returned = merged.transpose(1, 2)
    return returned, (returned if out.dtype == q.dtype else out.reshape(q.shape))
