"""`partita generate`'s prompts at the edges: an empty one starts the text where the
training text starts (after a newline, byte tokenizer; at BOS, a tokenizer that has
one) and prints only what was generated."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from partita.config import load_config
from partita.data import ByteTokenizer
from partita.errors import PartitaError
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
