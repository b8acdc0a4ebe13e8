"""Overrides as users write them: a config file after a flag is the config file, never
the flag's value; a setting without its section is named with it; one without a value
says so; one given twice takes its later value, as the config file's value gives way to
an override (wrapper scripts pass their defaults first, then the user's words)."""

from __future__ import annotations

import pytest

import partita.commands.train as train_command
from partita.cli import main
from partita.config import load_config, parse_overrides
from partita.errors import PartitaError


@pytest.fixture
def seen(monkeypatch):
    """What `partita train` would run with: its config file and overrides."""
    got: dict = {}

    def fake_run(args):
        got.update(config=args.config, overrides=args.overrides)
        return 0

    monkeypatch.setattr(train_command, "run", fake_run)
    return got


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("words,config,overrides", [
    (["--nproc", "4", "--parallel.tp=2", "--parallel.sequence_parallel", "r.toml"], "r.toml",
     ["--parallel.tp=2", "--parallel.sequence_parallel"]),
    (["--train.steps", "2", "r.toml"], "r.toml", ["--train.steps", "2"]),
    (["--parallel.sequence_parallel", "true", "r.toml"], "r.toml",
     ["--parallel.sequence_parallel", "true"]),
    (["--model.tie_embeddings", "--train.steps", "2", "R.TOML"], "R.TOML",
     ["--model.tie_embeddings", "--train.steps", "2"]),
    (["r.toml", "--train.steps", "5"], "r.toml", ["--train.steps", "5"]),
    # An option's value that is also a setting's: not the config file.
    (["--nproc", "2", "--train.steps", "2"], None, ["--train.steps", "2"]),
    (["--nproc", "2", "--train.steps", "2", "r.toml"], "r.toml", ["--train.steps", "2"]),
])
def test_a_config_file_after_a_flag_is_the_config_file(seen, words, config, overrides):
    assert main(["train", *words]) == 0
    assert seen == {"config": config, "overrides": overrides}


def test_a_toml_word_is_never_a_setting_s_value():
    assert parse_overrides(["--parallel.sequence_parallel", "--train.steps", "3"]) == [
        ("parallel.sequence_parallel", None), ("train.steps", "3")]
    with pytest.raises(PartitaError, match="cannot read the argument 'b.toml'.* One config "
                                           "file is read, and it goes first: partita train "
                                           "run.toml --section.key=value"):
        parse_overrides(["--parallel.sequence_parallel", "b.toml"])


def test_a_flag_before_a_missing_config_file_names_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PartitaError, match="config file 'gone.toml' does not exist"):
        train_command.run(_args(["--parallel.sequence_parallel", "gone.toml"]))


def _args(words):
    from partita.cli import _parse

    return _parse(["train", *words])


def test_a_second_config_file_is_named(tmp_path):
    with pytest.raises(PartitaError, match="cannot read the argument 'b.toml'.* One config "
                                           "file is read"):
        load_config(None, ["--train.steps=2", "b.toml"])


# A setting without its section, or without its value ---------------------------------

@pytest.mark.parametrize("words,hint", [
    (["--steps=5"], "unrecognized arguments: --steps=5. Did you mean '--train.steps=5'?"),
    (["--lr", "0.1"], "Did you mean '--train.lr=0.1'?"),
    (["--global-batch", "8"], "Did you mean '--train.global_batch=8'?"),
    (["--seed=3"], "Did you mean '--model.seed=3' or '--data.seed=3'?"),
    (["--sequence_parallel"], "Did you mean '--parallel.sequence_parallel=...'?"),
])
def test_a_setting_without_its_section_is_named_with_it(words, hint, capsys):
    assert hint in _refused(["train", *words], capsys)


@pytest.mark.parametrize("words,message", [
    (["--train.lr"], "--train.lr is given without a value; give one, for example "
                     "--train.lr=0.001 (only true-or-false settings may be given bare"),
    (["--train.steps", "--train.lr=0.1"], "--train.steps is given without a value"),
    (["--train.out_dir"], "--train.out_dir is given without a value"),
    (["--model.n_layers"], "--model.n_layers is given without a value"),
])
def test_a_setting_given_without_a_value_says_so(words, message):
    with pytest.raises(PartitaError) as refused:
        load_config(None, words)
    assert message in str(refused.value) and "'true'" not in str(refused.value)


def test_a_bare_true_or_false_setting_is_true():
    cfg = load_config(None, ["--parallel.sequence_parallel", "--model.tie_embeddings"])
    assert cfg.parallel.sequence_parallel is True and cfg.model.tie_embeddings is True
    assert load_config(None, ["--train.overwrite=true"]).train.overwrite is True


# A setting given twice ----------------------------------------------------------------

def test_a_setting_given_twice_takes_its_later_value(seen):
    assert main(["train", "--train.steps=1000", "--parallel.tp=2", "--train.steps", "5"]) == 0
    assert load_config(None, seen["overrides"]).train.steps == 5


def test_an_override_of_the_config_file_s_value_is_fine(seen, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 1000\n")
    assert main(["train", str(path), "--train.steps=5"]) == 0
    assert load_config(seen["config"], seen["overrides"]).train.steps == 5
