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
