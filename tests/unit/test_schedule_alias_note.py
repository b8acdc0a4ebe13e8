"""A deprecated schedule name (zbh1, zero-bubble, interleaved) on the command line is one
`partita: note:` line, not a Python warning per resolution naming partita's source;
the launched processes and the run's config.toml get the current name."""

from __future__ import annotations

import pytest

import partita.commands.train as train_command
from partita import layout as layout_module
from partita.cli import main
from partita.config import Config, load_config


@pytest.mark.parametrize("old,new", [("zbh1", "zb-h1"), ("zero-bubble", "zb-h1"),
                                     ("interleaved", "interleaved-1f1b")])
def test_a_deprecated_schedule_is_one_note(monkeypatch, capsys, old, new):
    monkeypatch.setattr(layout_module, "_NOTED", set())
    monkeypatch.delenv("RANK", raising=False)

    def fake_run(args):  # the launcher resolves the layout more than once
        cfg = load_config(args.config, args.overrides)
        for _ in range(3):
            assert cfg.layout(2).schedule == new
        assert f'schedule = "{new}"' in cfg.to_toml()  # what the processes read
        return 0

    monkeypatch.setattr(train_command, "run", fake_run)
    assert main(["train", "--parallel.pp=2", f"--parallel.schedule={old}",
                 "--train.microbatches=4"]) == 0
    err = capsys.readouterr().err
    assert err == f"partita: note: schedule '{old}' is deprecated; write '{new}' instead.\n"


def test_the_note_is_rank_0_s_and_other_warnings_stay_warnings(monkeypatch, capsys):
    import warnings

    monkeypatch.setattr(layout_module, "_NOTED", set())
    monkeypatch.setenv("RANK", "1")
    layout_module.notes_for_old_spellings()
    layout_module.canonical_schedule("zbh1")
    assert capsys.readouterr().err == ""
    with pytest.warns(UserWarning, match="unrelated"):
        warnings.warn("unrelated", UserWarning, stacklevel=1)


def test_the_saved_configuration_names_the_current_schedule():
    cfg = Config()
    cfg.parallel.schedule = "zbh1"
    assert 'schedule = "zb-h1"' in cfg.to_toml()
