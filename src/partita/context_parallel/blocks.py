"""Attention of one block of queries against one block of keys, with its log-sum-exp.

Both context-parallel kinds compute attention piecewise: a query chunk against the key
chunks it may see, one at a time (ring) or at once (all-gather). Each piece returns its
normalised output and the log-sum-exp of its scores, and pieces merge exactly:

    lse = logaddexp(lse_a, lse_b),  out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse).

The backward of a piece needs only the final output and log-sum-exp (flash attention's
rule), so no piece's probabilities are kept between forward and backward.

Grouped-query attention: queries are (b, g, r, s, d) for g kv heads of r query heads
each, keys and values (b, g, s, d); a kv head is never repeated in memory.

Pieces compute in at least float32 (`compute_dtype`): 16-bit scores and log-sum-exps
would lose the precision the merges rely on. What travels keeps the model's dtype.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """True where a query may not see a key, for a diagonal block whose last query and
    last key are the same position (the keys may start earlier)."""
    q_pos = torch.arange(q_len, device=device) + (k_len - q_len)
    return torch.arange(k_len, device=device)[None, :] > q_pos[:, None]


def within_documents(mask: torch.Tensor | None, segments: torch.Tensor | None,
                     q_start: int, q_len: int, k_start: int, k_len: int
                     ) -> torch.Tensor | None:
    """`mask` (True: hidden) with also every key of another document hidden, for the
    queries at sequence positions q_start.. and keys at k_start.. of packed rows whose
    documents `segments` (b, s: the whole sequence) numbers; None: one document a row."""
    if segments is None:
        return mask
    sq = segments[:, q_start:q_start + q_len]
    sk = segments[:, k_start:k_start + k_len]
    other = (sq[:, :, None] != sk[:, None, :])[:, None, None]  # (b, 1, 1, sq, sk)
    return other if mask is None else other | mask


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a query that sees no key of a piece) as 0, to subtract safely."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q (b, g, r, sq, d) against k, v (b, g, sk, d)."""
    work = compute_dtype(q.dtype)
    q, k, v = q.to(work), k.to(work), v.to(work)
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
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


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             mask: torch.Tensor | None, grad_out: torch.Tensor, lse: torch.Tensor,
             delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one piece, given the final lse and delta = rowsum(dO * O)."""
    work = compute_dtype(q.dtype)
    q, k, v, grad_out = q.to(work), k.to(work), v.to(work), grad_out.to(work)
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), grad_out).sum(dim=2)
    dprobs = torch.matmul(grad_out, v.unsqueeze(2).transpose(-1, -2))
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    dq = torch.matmul(dscores, k.unsqueeze(2))
    dk = torch.matmul(dscores.transpose(-1, -2), q).sum(dim=2)
    return dq, dk, dv


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, h, s, d) -> (b, g, h/g, s, d): query heads grouped by the kv head they read."""
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, s, d)
