"""A vocabulary padded to a multiple of model.vocab_multiple: the setting and its checks,
the rows it adds (counted, drawn as the unpadded model's), a loss and sampling that never
see them, a checkpoint of other padding refused before any weight loads, and the GPU
warning. Training parity with the unpadded model: tests/dist/test_vocab_padding.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from partita.checkpoint import CheckpointMismatch, load_checkpoint, read_manifest
from partita.checkpoint.manifest import MANIFEST, check_model, model_fields, write_manifest
from partita.config import load_config
from partita.errors import PartitaError
from partita.layout import Layout
from partita.layout_rules import find_problems
from partita.loss import FUSED_UP_TO
from partita.mesh import Mesh
from partita.models.catalog import MODELS
from partita.models.model_config import ModelConfig, vocab_alignment_warning
from partita.models.transformer import build_model, transformer_init
from partita.parallelize import build_parallel_model
from partita.sampling import generate
from partita.sharding import ShardInfo, init_shard
from partita.testing import PARITY_MODEL, parity_config, train_layout

VOCAB, ROWS = 250, 256
PADDED = ModelConfig(**dict(PARITY_MODEL, vocab_size=VOCAB, vocab_multiple=64))


@pytest.mark.parametrize("bad", [0, -64, 2.5, True, "64"])
def test_vocab_multiple_must_be_a_positive_integer(bad):
    with pytest.raises(PartitaError, match=f"model.vocab_multiple must be a positive "
                                           f"integer.*got {bad!r}"):
        ModelConfig(vocab_multiple=bad)
    with pytest.raises(PartitaError, match="model.vocab_multiple"):
        load_config(None, ["--model.vocab_multiple=0"])


def test_padded_size_and_parameter_counts():
    assert PADDED.padded_vocab_size == ROWS
    assert dataclasses.replace(PADDED, vocab_multiple=1).padded_vocab_size == VOCAB
    assert dataclasses.replace(PADDED, vocab_multiple=125).padded_vocab_size == VOCAB
    assert load_config(None, ["--model.vocab_multiple=64"]).model_config().vocab_multiple == 64
    # The catalog's GPT-2 shapes store 50,304 rows, and count them.
    gpt2 = MODELS["gpt2-124m"]
    assert (gpt2.vocab_size, gpt2.padded_vocab_size) == (50257, 50304)
    assert MODELS["gpt3-175b"].padded_vocab_size == 50304
    assert gpt2.num_params() == 124_475_904  # 124,439,808 unpadded + 47 x 768
    for cfg in (PADDED, dataclasses.replace(PADDED, flavour="gpt2", tie_embeddings=True), gpt2):
        meta = build_model(cfg, device="meta")
        assert sum(p.numel() for p in meta.parameters()) == cfg.num_params()
        assert meta.tok_embeddings.weight.shape[0] == cfg.padded_vocab_size


def test_real_rows_are_drawn_as_the_unpadded_models_and_shards_as_slices():
    padded = build_model(PADDED, dtype=torch.float64)
    plain = build_model(dataclasses.replace(PADDED, vocab_multiple=1), dtype=torch.float64)
    for name in ("tok_embeddings.weight", "output.weight"):
        full = padded.get_parameter(name)
        assert full.shape == (ROWS, PADDED.dim)
        assert torch.equal(full[:VOCAB], plain.get_parameter(name))
        # A tensor-parallel rank's rows of the padded vocabulary: the same slice.
        info = ShardInfo(name, tuple(full.shape), 0, ROWS // 2, ROWS)
        shard = init_shard(transformer_init(PADDED), info).to(torch.float64)
        assert torch.equal(shard, full[ROWS // 2:])


@pytest.mark.parametrize("tokens", [8, 2 * FUSED_UP_TO // ROWS])  # both loss paths
def test_the_runs_loss_gives_the_padding_no_probability(tokens):
    loss_fn = _model(_config(64)).loss_fn  # the loss a one-process run trains with
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, ROWS, dtype=torch.float64, generator=gen)
    logits[:, VOCAB:] = 50.0  # would take nearly all the probability
    logits.requires_grad_(True)
    targets = torch.randint(VOCAB, (tokens,), generator=gen)
    loss = loss_fn(logits, targets)
    want = F.cross_entropy(logits[:, :VOCAB], targets)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    loss.backward()
    assert torch.all(logits.grad[:, VOCAB:] == 0)


def test_sampling_never_returns_a_padded_id():
    model = build_model(PADDED).eval()
    # Padded logits far above every real one, whatever the hidden state.
    model.output.register_forward_hook(lambda _m, _i, out: out.index_fill(
        -1, torch.arange(VOCAB, ROWS), 1e9))
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]]))[0, -1].argmax() >= VOCAB  # unmasked: padding
    for temperature, top_k in ((0.0, 0), (1.0, 0), (2.0, 5)):
        ids = generate(model, [1, 2, 3], 20, temperature=temperature, top_k=top_k, seed=1)
        assert max(ids[3:]) < VOCAB, (temperature, top_k, ids)


def test_a_split_rule_reads_the_padded_vocabulary():
    tiny = dataclasses.replace(PADDED, vocab_size=3, vocab_multiple=1)
    layout = Layout(tp=4)
    assert any("model.vocab_size=3" in p.message
               for p in find_problems(layout, tiny, 4, seq_len=16, global_batch=4))
    padded = dataclasses.replace(tiny, vocab_multiple=64)
    assert not any("vocab" in p.message
                   for p in find_problems(layout, padded, 4, seq_len=16, global_batch=4))


def test_the_gpu_warning_names_the_flag():
    gpt2 = MODELS["gpt2-124m"]
    text = vocab_alignment_warning(dataclasses.replace(gpt2, vocab_multiple=1))
    assert "50,257 wide" in text and "--model.vocab_multiple=64" in text and "50,304" in text
    assert vocab_alignment_warning(gpt2) is None
    assert vocab_alignment_warning(gpt2, tp=8) is None  # 6,288 rows per rank
    wide = vocab_alignment_warning(gpt2, tp=32)  # 1,572 rows per rank
    assert "(tp=32)" in wide and "--model.vocab_multiple=256" in wide


# Checkpoints ---------------------------------------------------------------------------

def _config(multiple: int, **train):
    return parity_config(model=dict(vocab_size=VOCAB, vocab_multiple=multiple), train=train)


def _model(cfg):
    return build_parallel_model(cfg, Mesh(Layout(), 0, 1), torch.device("cpu"))


def test_a_checkpoint_of_other_padding_is_refused_before_any_weight_loads(tmp_path):
    from partita.commands.run_folders import check_run_dir

    saved_cfg = _config(64)
    train_layout(0, 1, saved_cfg, steps=1, save_to=str(tmp_path / "ckpt"))
    folder = next((tmp_path / "ckpt").glob("step-*"))
    assert read_manifest(folder)["model"]["vocab_multiple"] == 64
    want = (r"padded vocabulary: checkpoint 256 rows \(vocab_multiple=64\), this run 250 "
            r"\(vocab_multiple=1\)\). Resume with --model.vocab_multiple=64")
    pm = _model(_config(1))
    before = {n: p.detach().clone() for n, p in pm.module.named_parameters()}
    with pytest.raises(CheckpointMismatch, match=want):
        load_checkpoint(pm, folder)
    assert all(torch.equal(p, before[n]) for n, p in pm.module.named_parameters())
    # Before launch too, as `partita train --train.resume=...` checks it.
    run = _config(1, resume=str(folder), out_dir=str(tmp_path / "run"))
    with pytest.raises(CheckpointMismatch, match=want):
        check_run_dir(run)
    # Another multiple that pads to the same rows builds the same weights: it resumes.
    load_checkpoint(_model(_config(128)), folder)
    # A checkpoint written before vocab_multiple existed was unpadded.
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["model"]["vocab_multiple"], manifest["crc32"]
    write_manifest(folder, manifest)
    with pytest.raises(CheckpointMismatch, match=r"Resume with --model.vocab_multiple=1,"):
        load_checkpoint(_model(_config(64)), folder)


def test_other_differences_are_listed_with_the_padding(tmp_path):
    saved = {"model": json.loads(json.dumps(model_fields(PADDED)))}
    other = dataclasses.replace(PADDED, n_layers=3, vocab_multiple=1)
    with pytest.raises(CheckpointMismatch, match=r"n_layers: checkpoint 2, this run 3; padded "
                                                 r"vocabulary: checkpoint 256 rows"):
        check_model(saved, other, tmp_path)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300])
def test_a_temperature_near_zero_samples_like_greedy(temperature):
    """Logits divided by 1e-40 overflowed float32 (NaN probabilities, a traceback in
    `partita generate`); near zero, sampling is the argmax, as at temperature 0."""
    model = build_model(PADDED).eval()
    greedy = generate(model, [1, 2, 3], 8, temperature=0.0)
    assert generate(model, [1, 2, 3], 8, temperature=temperature, seed=3) == greedy
