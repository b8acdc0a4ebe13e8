"""Packed documents: which document each token belongs to, and who may attend to whom.

Training packs documents end to end into fixed-length rows, each ended by the
tokenizer's end-of-document token. `document_ids` numbers the documents of a row from
its tokens alone (a token belongs to the document after the last end token before it),
so every rank that holds the row's tokens -- every pipeline stage, every tensor-parallel
peer -- derives the same numbering without communication.

`attention_mask` is causal attention restricted to a token's own document: the block
diagonal of the causal mask. Under it a packed row computes what each document would
compute alone, because rotary embeddings make scores depend only on the distance
between two positions, never on where a document starts (a learned absolute position
embedding, GPT-2's, does depend on it: that flavour sees each document at its offset
in the row).
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, end_token: int) -> torch.Tensor:
    """(batch, seq) int64: 0 for the tokens up to and including the row's first end
    token, 1 up to the second, and so on."""
    ends = (tokens == end_token).to(torch.int64)
    # Exclusive cumulative sum: the end token itself still belongs to its document.
    return ends.cumsum(dim=1) - ends


def attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True where query i may attend to key j: j <= i and
    both in the same document (broadcasts over heads)."""
    s = segments.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    return (same & causal)[:, None]
