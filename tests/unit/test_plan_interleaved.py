"""interleaved-1f1b needs two or more virtual stages: `--layout` fills in partita
train's default (2) and says so; an explicit 1 is refused, in --layout and --fix."""

import json

from partita.cli import main
from partita.layout import Layout
from partita.layout_rules import CONSTRAINT
from partita.planner import evaluate_layout

PLAN = ["plan", "--model", "llama3-70b", "--gpus", "64", "--gpu-type", "H200"]
LAYOUT = "dp=2 tp=8 pp=4 zero_stage=1 microbatch_size=1 recompute=full"
REFUSAL = "schedule=interleaved-1f1b with virtual_stages=1 has nothing to interleave"


def test_interleaved_without_virtual_stages_takes_trains_default(capsys):
    assert main([*PLAN, "--layout", LAYOUT + " schedule=interleaved-1f1b"]) == 0
    out = capsys.readouterr().out
    assert "virtual_stages=2 (interleaved-1f1b's default, as partita train fills it in)" in out
    # Planned as the two-stage interleaving it runs: the same numbers as given explicitly.
    assert main([*PLAN, "--layout", LAYOUT + " schedule=interleaved-1f1b virtual_stages=2"]) == 0
    explicit = capsys.readouterr().out
    pick = [line for line in out.splitlines() if line.startswith(("  total", "Step"))]
    assert pick == [line for line in explicit.splitlines()
                    if line.startswith(("  total", "Step"))]


def test_interleaved_with_one_virtual_stage_is_refused(capsys):
    assert main([*PLAN, "--layout", LAYOUT + " schedule=interleaved-1f1b virtual_stages=1"]) == 2
    assert capsys.readouterr().err.count(REFUSAL) == 1  # train's rule, said once
    assert main([*PLAN, "--fix", "schedule=interleaved-1f1b,virtual_stages=1"]) == 2
    assert REFUSAL in capsys.readouterr().err
    ev = evaluate_layout("llama3-70b", 64, Layout(dp=2, tp=8, pp=4, schedule="interleaved-1f1b"))
    assert any(kind == CONSTRAINT and REFUSAL in text for kind, text in ev.reasons)


def test_pinned_interleaving_still_searches_its_virtual_stages(capsys):
    assert main([*PLAN, "--fix", "schedule=interleaved-1f1b", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and all(r["degrees"]["virtual_stages"] >= 2 for r in ranked)
