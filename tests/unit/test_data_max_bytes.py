"""What a run's `[data]` says it does with a source: `data.max_bytes` beside a source
(it budgets only the built-in corpus) and the note about a tokenizer without BOS or EOS
(records still end with a newline) say what preparing the tokens does."""

from __future__ import annotations

import json

import pytest

from partita.commands.train_notes import print_notes
from partita.config import load_config
from partita.data import load_dataset
from partita.data.dataset import data_notes, load_configured


def _data(tmp_path, *extra: str):
    return load_config(None, ["--data.seq_len=16", f"--data.cache_dir={tmp_path}", *extra]).data


def test_max_bytes_beside_a_source_is_noted_once_as_not_applied(tmp_path, capsys):
    """It was dropped silently: 1,000 asked, the whole 20 kB file trained on. The note was
    then printed by every process that opened the data as well as before launch; it is
    said once per job, by `print_notes`."""
    src = tmp_path / "uni.txt"
    src.write_text("some small text. " * 1200)
    given = _data(tmp_path, f"--data.source={src}", "--data.max_bytes=1000")
    data = load_configured(given, tmp_path)
    assert data.num_tokens == src.stat().st_size  # read whole, as the note says
    assert capsys.readouterr().err == ""  # opening the data says nothing
    [note] = data_notes(given)
    assert "data.max_bytes=1000 is not applied" in note
    assert f"data.source '{src}' is read whole" in note
    print_notes(load_config(None, [f"--data.source={src}", "--data.max_bytes=1000",
                                   f"--train.out_dir={tmp_path / 'run'}"]))
    assert capsys.readouterr().err.count("data.max_bytes=1000 is not applied") == 1
    assert data_notes(_data(tmp_path, f"--data.source={src}")) == []  # the default


def test_the_note_of_a_tokenizer_without_bos_or_eos_says_records_end_with_a_newline(
        tmp_path):
    """The note said documents were packed without separators, but every record gets a
    newline."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(["alpha beta\n", "gamma delta\n"] * 20, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    from partita.data.hf_tokenizer import HFTokenizer

    hf = HFTokenizer(folder)
    note = hf.framing_note()
    assert note is not None and "each end with a newline" in note
    records = tmp_path / "docs.jsonl"
    records.write_text("".join(json.dumps({"text": t}) + "\n"
                               for t in ["alpha beta", "gamma delta"] * 20))
    data = load_dataset(records, tmp_path / "cache", seq_len=4, tokenizer=hf,
                        val_fraction=0)
    lines = hf.decode(data.train).split("\n")  # ByteLevel decodes a leading space
    assert [line.strip() for line in lines[:3]] == ["alpha beta", "gamma delta", "alpha beta"]
