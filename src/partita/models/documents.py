"""Packed documents: which document each token belongs to, and who may attend to whom.

Training packs documents end to end into fixed-length rows. A stream marks where one
document gives way to the next with one token, its *boundary*, of one of two kinds:

- an end token (a plain int: the tokenizer's EOS, when it differs from BOS or there is
  no BOS). It closes its document: it belongs to the document before it, and the token
  after it starts the next one.
- a start token (`DocumentStart`: the BOS of a tokenizer whose EOS is the same token,
  GPT-2's `<|endoftext|>`, or that has no EOS). Every document begins with it and nothing
  else separates documents, so it belongs to the document it opens; predicting it is
  how the document before learns to end.

`document_ids` numbers the documents of a row from its tokens alone, so every rank that
holds the row's tokens -- every pipeline stage, every tensor-parallel peer -- derives
the same numbering without communication.

`attention_mask` is causal attention restricted to a token's own document: the block
diagonal of the causal mask. Under it a packed row computes what each document would
compute alone, because rotary embeddings make scores depend only on the distance
between two positions, never on where a document starts (a learned absolute position
embedding, GPT-2's, does depend on it: that flavour sees each document at its offset
in the row).

torch is imported where tensors are made: the data pipeline names `DocumentStart`
in tokenizer worker processes, which need none of torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class DocumentStart(int):
    """A boundary token that opens each document rather than closing it (see the module
    docstring). It is an int, so code that only compares tokens with the boundary needs
    no change; code that numbers documents or masks targets asks `starts_documents`."""

    def __repr__(self) -> str:
        return f"DocumentStart({int(self)})"

    def __reduce__(self):  # pickles as itself, not as a plain int
        return DocumentStart, (int(self),)


def starts_documents(boundary: int | None) -> bool:
    """True when `boundary` opens documents (`DocumentStart`), False for an end token."""
    return isinstance(boundary, DocumentStart)


def document_ids(tokens: torch.Tensor, boundary: int) -> torch.Tensor:
    """(batch, seq) int64 document numbers of a row, counted from 0.

    An end token (a plain int) stays in the document it closes: 0 up to and including
    the row's first end token, 1 up to the second, and so on. A start token
    (`DocumentStart`) opens the document it is in: 0 before the row's first start
    token, 1 from it up to the next one, and so on."""
    import torch

    marks = (tokens == int(boundary)).to(torch.int64)
    ids = marks.cumsum(dim=1)
    # An end token's own position takes the count before it (an exclusive sum).
    return ids if starts_documents(boundary) else ids - marks


def attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True where query i may attend to key j: j <= i and
    both in the same document (broadcasts over heads)."""
    import torch

    s = segments.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    return (same & causal)[:, None]
