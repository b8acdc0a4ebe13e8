"""Numeric options out of range and unknown bench models are refused while the command
line is parsed (`partita.arg_types`, `partita.bench.models.model_name`): exit status 2,
argparse's one-line message naming the option, nothing built or launched."""

from __future__ import annotations

import pytest

from partita.cli import main


@pytest.mark.parametrize("argv,message", [
    (["generate", "--tokens", "-3"], "argument --tokens: -3 is out of range: use 0 or more"),
    (["generate", "--temperature", "-0.5"],
     "argument --temperature: -0.5 is out of range: use 0.0 or more"),
    (["generate", "--temperature", "nan"],
     "argument --temperature: 'nan' is not a finite number"),
    (["generate", "--top-k", "two"], "argument --top-k: 'two' is not a whole number"),
    (["bench", "dp", "--rounds", "0"], "argument --rounds: 0 is out of range: use 1 or more"),
    (["bench", "zero", "--worlds", "2", "0"],
     "argument --worlds: 0 is out of range: use 1 or more"),
    (["bench", "compile", "--worlds", "1,x"], "argument --worlds: 'x' is not a whole number"),
    (["bench", "zero", "--model", "tyny"],
     "argument --model: unknown model 'tyny'. Did you mean 'tiny'?"),
])
def test_out_of_range_arguments_stop_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["bench", "dp", "--worlds", "2"],
     "partita bench dp: error: unrecognized arguments: --worlds 2. Did you mean '--world'?"),
    (["generate", "--prompts", "x"],
     "partita generate: error: unrecognized arguments: --prompts x. Did you mean '--prompt'?"),
    (["bench", "tp", "--degrees", "3"], "partita bench tp: error: unrecognized arguments: "
                                        "--degrees 3.\n"),
])
def test_an_unknown_option_is_named_by_its_own_command(argv, message, capsys):
    """The (sub)command that does not take an option says so, with its own usage and
    a near option when there is one."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith(f"usage: partita {' '.join(argv[:2 if argv[0] == 'bench' else 1])}")


def test_plan_accuracy_names_the_world_sizes_it_has(capsys):
    assert main(["bench", "plan-accuracy", "--worlds", "1,3"]) != 0
    assert ("--worlds: no layouts of 3 ranks; plan-accuracy runs worlds of 1, 2, 4, 8 ranks"
            in capsys.readouterr().err)


def test_train_takes_an_override_with_a_space_or_in_two_words(monkeypatch):
    """argparse takes a word with a space for a positional argument, and the value of
    `--train.steps 5` too: both landed in the config file's place ("config file ... does
    not exist"). They are overrides, kept in their order among the others."""
    import partita.commands.train as train_command

    seen = {}

    def fake_run(args):
        seen["config"], seen["overrides"] = args.config, args.overrides
        return 0

    monkeypatch.setattr(train_command, "run", fake_run)
    mix = "--data.mix=a.jsonl=0.7, b.jsonl=0.3"
    assert main(["train", "--train.steps=2", mix, "--train.lr=0.1"]) == 0
    assert seen == {"config": None, "overrides": ["--train.steps=2", mix, "--train.lr=0.1"]}
    assert main(["train", "--train.steps", "5"]) == 0
    assert seen == {"config": None, "overrides": ["--train.steps", "5"]}
    assert main(["train", "run.toml", "--train.steps", "5"]) == 0
    assert seen == {"config": "run.toml", "overrides": ["--train.steps", "5"]}


def test_a_mistyped_launcher_option_is_named_not_read_as_a_setting(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--nprocs", "2", "--train.steps=1"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --nprocs. Did you mean '--nproc'?" in capsys.readouterr().err


@pytest.mark.parametrize(("words", "hint"), [
    (["--model", "small"], "Did you mean '--model.name=small'?"),
    (["--model=llama-20m"], "Did you mean '--model.name=llama-20m'?"),
    (["--train", "--train.steps=1"], "'train' is a section of settings: write "
                                     "--train.FIELD=VALUE (its fields include steps,"),
    (["--learning_rate=0.1"], "Did you mean '--train.lr=0.1'?"),
    (["--tensor-model-parallel-size", "2"], "Did you mean '--parallel.tp=2'?"),
])
def test_a_setting_without_its_section_gets_the_setting_form(words, hint, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", *words])
    assert stop.value.code == 2
    assert hint in capsys.readouterr().err


@pytest.mark.parametrize("argv,dest,expected", [
    (["bench", "zero", "--worlds", "2", "4"], "worlds", [2, 4]),
    (["bench", "zero", "--worlds", "2,4"], "worlds", [2, 4]),
    (["bench", "zero", "--stages", "0,3", "2"], "stages", [0, 3, 2]),
    (["bench", "compile", "--worlds", "1", "2"], "worlds", [1, 2]),
    (["bench", "ep", "--worlds", "4"], "worlds", [4]),
    (["bench", "cp", "--degrees", "2", "4"], "degrees", [2, 4]),
    (["bench", "checkpoint", "--worlds", "4,2"], "worlds", [4, 2]),
    (["bench", "plan-accuracy", "--worlds", "1", "2,4"], "worlds", [1, 2, 4]),
    (["bench", "pp", "--stages", "2,4", "--schedules", "1f1b,gpipe"], "schedules",
     ["1f1b", "gpipe"]),
    (["bench", "pp-bubble", "-p", "2", "4"], "stages", [2, 4]),
])
def test_every_list_option_takes_spaces_and_commas(argv, dest, expected):
    """Some benchmarks read `--worlds 2 4`, others `--worlds 2,4`, and each refused the
    other's spelling; every list option now takes both, and mixes of them."""
    from partita.cli import parser_for

    assert getattr(parser_for(argv).parse_args(argv), dest) == expected


@pytest.mark.parametrize("argv,message", [
    (["bench", "zero", "--stages", "4"], "argument --stages: '4' is not one of 0, 1, 2, 3"),
    (["bench", "pp", "--schedules", "1f1b,gpipe2"],
     "argument --schedules: 'gpipe2' is not one of"),
    (["bench", "zero", "--worlds", "2,,4"], "argument --worlds: '' is not a whole number"),
])
def test_a_bad_item_of_a_list_option_is_named(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_a_round_cap_below_the_first_rounds_is_refused(capsys):
    """Rounds double from --rounds up to --max-rounds; a cap the user gave below the
    start was silently ignored. (A --rounds beyond the default cap still lifts it.)"""
    assert main(["bench", "dp", "--rounds", "8", "--max-rounds", "4"]) == 2
    err = capsys.readouterr().err
    assert ("--rounds 8 is more than --max-rounds 4, the most rounds a pair may take: "
            "give --max-rounds 8 or more, or fewer --rounds." in err)
