"""Small checks of partita plan's messages and inputs, and of bench plan-accuracy's."""

import pytest

from partita.cli import main
from partita.layout import Layout
from partita.planner import evaluate_layout, make_request
from partita.planner.evaluate import Evaluation, memory_reasons


def test_an_overflow_never_reads_as_equal():
    req = make_request("llama3-8b", 8, "A100-80GB")
    cases = ((80.04e9, "needs 80.04 GB per GPU on stage 0, A100-80GB has 80 GB"),
             (80.0004e9, "needs 80.0004 GB per GPU on stage 0, A100-80GB has 80 GB"),
             (99.23e9, "needs 99.2 GB per GPU on stage 0, A100-80GB has 80 GB"))
    for total, says in cases:
        ev = Evaluation(Layout(dp=8), memory={"total": total})
        assert memory_reasons(req, ev) == [("memory", says)]


def test_tp_suggestions_stay_within_a_node():
    ev = evaluate_layout("llama3-8b", 8, Layout(dp=2, tp=3, sequence_parallel=True))
    seq_rule = next(r for _, r in ev.reasons if r.startswith("--seq-len=8192"))
    assert seq_rule.endswith("or a tp degree among [1, 2, 4, 8].")


@pytest.mark.parametrize("flag, value", [("--fix", ""), ("--fix", ","), ("--layout", ""),
                                         ("--layout", "  ")])
def test_empty_layout_and_pins_are_refused(capsys, flag, value):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", flag, value]) == 2
    assert f"{flag} is empty: give" in capsys.readouterr().err


def test_bench_plan_accuracy_checks_dim_before_any_rank(capsys, monkeypatch):
    from partita.bench import plan_accuracy

    def no_launch(args):
        raise AssertionError("ranks started")

    monkeypatch.setattr(plan_accuracy, "run", no_launch)
    assert main(["bench", "plan-accuracy", "--dim", "20", "--worlds", "1"]) == 2
    assert ("--dim 20: plan-accuracy's model has 4 attention heads of even width (rotary "
            "positions), so --dim must be a multiple of 8; try --dim 16 or 24."
            ) in capsys.readouterr().err


def test_bench_plan_accuracy_help_describes_it(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "plan-accuracy", "--help"])
    out = capsys.readouterr().out
    assert "The planner's predictions against partita's own measurements" in out
