"""Packed documents: a row of several documents under the document mask computes, per
document, what that document computes alone (float64, 1e-10), and plain causal
attention over the row does not."""

from __future__ import annotations

import torch

from partita.models.documents import attention_mask, document_ids
from partita.models.model_config import ModelConfig
from partita.models.transformer import build_model
from partita.testing import FLOAT64_TOL, assert_parity

END = 7
CFG = ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  max_seq_len=32, rope_theta=10000.0)


def test_document_ids_number_documents_and_keep_the_end_token_in_its_own():
    tokens = torch.tensor([[1, END, 2, 3, END, END, 4], [END, 1, 1, 1, 1, 1, 1]])
    assert document_ids(tokens, END).tolist() == [[0, 0, 1, 1, 1, 2, 3],
                                                  [0, 1, 1, 1, 1, 1, 1]]
    mask = attention_mask(document_ids(tokens, END))
    assert mask.shape == (2, 1, 7, 7)
    assert mask[0, 0, 3].tolist() == [False, False, True, True, False, False, False]


def _documents() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    docs = []
    for length in (5, 9, 1, 7):
        body = torch.randint(8, CFG.vocab_size, (length,), generator=gen)
        docs.append(torch.cat((body, torch.tensor([END]))))
    return docs


def test_packed_row_under_the_mask_equals_each_document_alone():
    model = build_model(CFG, dtype=torch.float64)
    docs = _documents()
    row = torch.cat(docs)[None]  # 26 tokens, 4 documents
    segments = document_ids(row, END)
    with torch.no_grad():
        packed = model(row, segments=segments)[0]
        plain = model(row)[0]
        alone = torch.cat([model(doc[None])[0] for doc in docs])
    assert_parity({"logits": packed}, {"logits": alone}, FLOAT64_TOL, "packed vs alone")
    # Without the mask, later documents see earlier ones: the check above can fail.
    first = len(docs[0])
    # Equal up to rounding, not bitwise: the CPU's matmul kernels block a 26-row input
    # differently from a shorter one on some machines (AMD EPYC, AVX2).
    assert_parity({"logits": plain[:first]}, {"logits": alone[:first]}, FLOAT64_TOL, "first")
    assert (plain[first:] - alone[first:]).abs().max() > 1e-3


def test_gradients_of_a_packed_row_equal_the_documents_summed():
    model = build_model(CFG, dtype=torch.float64)
    docs = _documents()
    row = torch.cat(docs)[None]
    loss = model(row, segments=document_ids(row, END)).logsumexp(-1).sum()
    packed = torch.autograd.grad(loss, list(model.parameters()))
    total = sum(model(doc[None]).logsumexp(-1).sum() for doc in docs)
    alone = torch.autograd.grad(total, list(model.parameters()))
    names = [n for n, _ in model.named_parameters()]
    assert_parity(dict(zip(names, packed)), dict(zip(names, alone)), FLOAT64_TOL,
                  "gradients packed vs alone")
