"""Where documents meet: the token between them (BOS == EOS tokenizers such as GPT-2's
included), the loss's targets and document ids around it, the same boundary for a token
file given alone or in a mix, junctions of a mixture, and a mixture's validation windows
covering every source."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from partita.data import load_dataset, write_token_file
from partita.data.dataset import boundary_token, load_mixture
from partita.data.sampler import IGNORE_INDEX, eval_batches, windows_to_batch
from partita.models.documents import DocumentStart, document_ids

tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota", "kappa lambda mu"]


def make_tokenizer(folder, bos: str | None, eos: str | None):
    """A small BPE tokenizer whose tokenizer_config.json names `bos` / `eos`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = sorted({t for t in (bos, eos) if t is not None})
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(
        vocab_size=80, special_tokens=["<unk>", *specials]))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {key: value for key, value in (("bos_token", bos), ("eos_token", eos)) if value}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    from partita.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(folder)


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_a_bos_that_is_also_the_eos_separates_documents_with_one_token(tmp_path):
    """GPT-2 style: `E doc E doc ...`, never `E doc E E doc E`. The separator opens the
    document after it: the text attends to it (as `partita generate` prompts after it),
    its target, the document's first token, is trained, and so is the one before it
    (the previous document learning to end)."""
    tok = make_tokenizer(tmp_path / "gpt2", "<|endoftext|>", "<|endoftext|>")
    end = tok.eos_id
    ds = load_dataset(write_jsonl(tmp_path / "docs.jsonl", TEXTS[:3]), tmp_path / "c", 4,
                      val_fraction=0, tokenizer=tok)
    stream = np.asarray(ds.train)
    bodies = [tok.encode(t).tolist() for t in TEXTS[:3]]
    assert stream.tolist() == [end, *bodies[0], end, *bodies[1], end, *bodies[2]]
    assert ds.boundary == end and isinstance(ds.boundary, DocumentStart)
    assert tok.frame([5, 6]).tolist() == [end, 5, 6]

    inputs, targets = windows_to_batch(stream, np.array([0]), len(stream) - 1, ds.boundary)
    assert targets[0].tolist() == stream[1:].tolist()  # nothing left out
    assert IGNORE_INDEX not in targets[0].tolist()
    ids = document_ids(inputs, ds.boundary)[0].tolist()
    first, second = 1 + len(bodies[0]), 1 + len(bodies[1])
    assert ids == [1] * first + [2] * second + [3] * (len(bodies[2]))


def test_the_boundary_of_each_kind_of_tokenizer():
    def of(bos, eos):
        return boundary_token(SimpleNamespace(bos_id=bos, eos_id=eos))

    assert of(1, 2) == 2 and not isinstance(of(1, 2), DocumentStart)  # EOS closes
    assert of(None, 2) == 2 and not isinstance(of(None, 2), DocumentStart)
    assert of(3, 3) == DocumentStart(3) and isinstance(of(3, 3), DocumentStart)
    assert isinstance(of(3, None), DocumentStart)  # BOS alone opens documents too
    assert of(None, None) is None


def test_document_ids_put_a_start_token_in_the_document_it_opens():
    tokens = torch.tensor([[4, 7, 1, 2, 7, 3, 7, 7, 5]])
    assert document_ids(tokens, DocumentStart(7)).tolist() == [[0, 1, 1, 1, 2, 2, 3, 4, 4]]
    assert document_ids(tokens, 7).tolist() == [[0, 0, 1, 1, 1, 2, 2, 3, 4]]
    _, targets = windows_to_batch(tokens[0].numpy(), np.array([0]), 8, DocumentStart(7))
    assert targets[0].tolist() == tokens[0, 1:].tolist()


def test_a_token_file_is_marked_by_the_configured_tokenizer_alone_or_in_a_mix(tmp_path):
    """One rule for a token file as data.source and inside data.mix: documents marked by
    data.tokenizer's boundary when one is given, unmarked when none is."""
    tok = make_tokenizer(tmp_path / "tok", "<s>", "</s>")
    source = write_jsonl(tmp_path / "docs.jsonl", TEXTS * 10)
    prepared = load_dataset(source, tmp_path / "c", 4, val_fraction=0, tokenizer=tok).path
    alone = load_dataset(prepared, tmp_path / "c", 4, tokenizer=tok)
    mixed = load_mixture(f"{prepared}=1, {source}=1", tmp_path / "c", 4, tokenizer=tok)
    assert alone.boundary == mixed.boundary == tok.eos_id
    assert alone.tokenizer is tok
    assert load_dataset(prepared, tmp_path / "c", 4).boundary is None
    plain = write_token_file(tmp_path / "plain.tok", np.arange(300) % 256, 256)
    assert load_mixture(f"{plain}=1, {plain}=1", tmp_path / "c", 4).boundary is None
    from partita.errors import PartitaError

    with pytest.raises(PartitaError, match=r"vocab size 256 but the tokenizer .* has \d+"):
        load_dataset(plain, tmp_path / "c", 4, tokenizer=tok)


def test_a_mixture_junction_is_a_document_boundary(tmp_path):
    """Each source's training part ends inside a document; the next part (or the same
    one, repeated) starts with BOS. An EOS is written between them, so no BOS follows
    anything but an EOS and document ids never join two sources."""
    tok = make_tokenizer(tmp_path / "tok", "<s>", "</s>")
    big = write_jsonl(tmp_path / "big.jsonl", TEXTS * 30)
    small = write_jsonl(tmp_path / "small.jsonl", TEXTS[::-1] * 3)
    ds = load_mixture(f"{big}=1, {small}=1", tmp_path / "c", 4, val_fraction=0.1,
                      tokenizer=tok)
    for region in (np.asarray(ds.train), np.asarray(ds.val)):
        starts = np.flatnonzero(region == tok.bos_id)
        starts = starts[starts > 0]
        assert len(starts) > 10
        assert (region[starts - 1] == tok.eos_id).all()
    # Every training part starts at its source's start, so every document (the small
    # source's repeats included) opens with BOS right after the EOS before it.
    train = np.asarray(ds.train)
    ends = np.flatnonzero(train[:-1] == tok.eos_id)
    assert train[0] == tok.bos_id and (train[ends + 1] == tok.bos_id).all()


def test_a_mixture_validation_evaluates_every_source(tmp_path):
    """With a large first source, the first windows of the validation part used to be
    all of it: A=0.5,B=0.5 and A=0.5,C=0.5 evaluated the same windows. The validation
    part now interleaves the sources, each by its weight, so the windows of even a
    single evaluation batch hold both, in proportion."""
    a = write_jsonl(tmp_path / "a.jsonl", ["a" * 99] * 2000)
    b = write_jsonl(tmp_path / "b.jsonl", ["b" * 99] * 100)
    ds = load_mixture(f"{a}=0.5, {b}=0.5", tmp_path / "c", 16, val_fraction=0.05)
    x = torch.cat([x for x, _ in eval_batches(ds.val, 16, 8, max_batches=1)])
    from_a, from_b = int((x == ord("a")).sum()), int((x == ord("b")).sum())
    assert from_b > 0 and 0.4 < from_a / (from_a + from_b) < 0.6
    val = np.asarray(ds.val)
    in_a, in_b = int((val == ord("a")).sum()), int((val == ord("b")).sum())
    assert 0.45 < in_a / (in_a + in_b) < 0.55  # weighted like the training part
