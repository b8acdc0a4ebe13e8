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


def test_plan_accuracy_names_the_world_sizes_it_has(capsys):
    assert main(["bench", "plan-accuracy", "--worlds", "1,3"]) != 0
    assert ("--worlds: no layouts of 3 ranks; plan-accuracy runs worlds of 1, 2, 4, 8 ranks"
            in capsys.readouterr().err)
