"""`partita generate`: the kept keys and values give the logits of a whole-sequence
forward, and sampling past the model's length, or with a capacity-limited mixture of
experts, runs as without them; an empty prompt starts the text where the training
text starts (after a newline, byte tokenizer; at BOS, a tokenizer that has one) and
prints only what was generated."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from partita.config import load_config
from partita.data import ByteTokenizer
from partita.errors import PartitaError
from partita.kv_cache import KVCache
from partita.models.transformer import build_model
from partita.sampling import generate, generate_text, load_run_model


def _run_dir(folder, *overrides: str):
    cfg = load_config(None, ["--model.name=tiny", *overrides])
    model = build_model(cfg.model_config())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(cfg.to_toml())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    return folder


def test_an_empty_prompt_prints_only_the_generated_bytes(tmp_path):
    """The newline the byte tokenizer starts from was printed as the text's first
    character."""
    run = _run_dir(tmp_path / "run")
    text = generate_text(run, "", 12, temperature=0.0)
    model, _ = load_run_model(run)
    expected = ByteTokenizer().decode(generate(model, [ord("\n")], 12, temperature=0.0)[1:])
    assert text == expected  # the old output was "\n" + expected


def test_an_empty_prompt_without_a_bos_token_is_refused(tmp_path):
    """With no BOS and no prompt there is nothing to start from; the model was called on
    an empty sequence (a traceback)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({}))
    run = _run_dir(tmp_path / "run", f"--data.tokenizer={tok_dir}")
    with pytest.raises(PartitaError, match="the prompt is empty.*no BOS token"):
        generate_text(run, "", 4)


def _float64_model(name: str, *overrides: str):
    cfg = load_config(None, [f"--model.name={name}", *overrides])
    return build_model(cfg.model_config()).double().eval()


def _whole_sequence_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """What sampling did before keys and values were kept: every token's logits from a
    forward over the last max_seq_len tokens."""
    ids, limit = list(prompt), model.cfg.max_seq_len
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids[-limit:]]))[0, -1, :model.cfg.vocab_size]
            ids.append(int(logits.argmax()))
    return ids


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt2", "tiny-moe"])
def test_kept_keys_and_values_give_the_whole_sequences_logits(name):
    """Rotary positions (llama), learned positions (gpt2), grouped kv heads and a
    dropless mixture of experts, in float64: a prompt of 9 tokens, then one at a time."""
    model = _float64_model(name)
    tokens = torch.arange(3, 23)[None]
    with torch.no_grad():
        whole = model(tokens)
        with KVCache(model) as cache:
            pieces = [cache.logits(tokens[:, :9])]
            pieces += [cache.logits(tokens[:, i:i + 1]) for i in range(9, tokens.shape[1])]
            assert cache.length == tokens.shape[1]
        torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=0, atol=1e-12)
        torch.testing.assert_close(model(tokens), whole, rtol=0, atol=0)  # model restored


@pytest.mark.parametrize("name,overrides", [
    ("tiny", ()),
    ("tiny-moe", ("--model.capacity_factor=1.0",)),  # tokens compete: whole sequences
])
def test_sampling_past_the_models_length_is_as_without_a_cache(name, overrides):
    model = _float64_model(name, *overrides)
    new = model.cfg.max_seq_len + 6 - 3  # the last tokens see a window of max_seq_len
    assert generate(model, [1, 2, 3], new, temperature=0.0) == \
        _whole_sequence_greedy(model, [1, 2, 3], new)


def test_sampling_ends_at_the_end_of_document_token():
    """A run's tokenizer with an EOS: the text ended there, rather than printing the
    EOS and sampling another document after it."""
    model = _float64_model("tiny")
    free = generate(model, [5, 6, 7], 30, temperature=0.0)
    # The greedy sequence's first new token is the stop token: sampling ends after it.
    stop = free[5]
    got = generate(model, [5, 6, 7], 30, temperature=0.0, stop_id=stop)
    assert got == free[:free.index(stop, 3) + 1]
    assert len(got) < len(free)
    # A stop token inside the prompt ends nothing.
    assert generate(model, [5, stop, 7], 4, temperature=0.0,
                    stop_id=-1) == generate(model, [5, stop, 7], 4, temperature=0.0)
