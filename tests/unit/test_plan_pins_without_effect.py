"""A search narrowed to options partita train does not run yet says what excluded its
layouts, and options that do nothing on a layout (tp_comm_overlap at tp=1, cp_kind at
cp=1, moe_tp on a dense model) are refused rather than planned as if honoured."""

from partita.cli import main
from partita.layout import Layout
from partita.layout_rules import CONSTRAINT
from partita.planner import evaluate_layout

H200_70B = ["plan", "--model", "llama3-70b", "--gpus", "64", "--gpu-type", "H200"]


def test_search_of_unavailable_options_says_what_excluded_them(capsys):
    assert main([*H200_70B, "--fix", "tp_comm_overlap=true"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert ("No layout partita can train fits: 1015 fit in memory but use options "
            "partita train does not run yet (below).") in lines
    assert "No layout fits." not in lines
    # Each example is shown with the reason it is listed under.
    for line in lines:
        if line.startswith("  does not fit: "):
            assert "GB per GPU on stage" in line and "not available yet" not in line
    assert any(line.startswith("  does not fit: ") for line in lines)
    # tp=1 layouts have no tp communication to overlap: a rule, not merely unavailable.
    assert ("  constraint: dp=64 tp=1 pp=1 zero_stage=0 microbatch_size=1 tp_comm_overlap=1: "
            "tp_comm_overlap=1 overlaps tensor-parallel communication, and tp=1 has none; "
            "set tp > 1 or drop tp_comm_overlap") in lines


def test_options_without_effect_are_refused(capsys):
    cases = (
        (Layout(dp=64, tp_comm_overlap=True), "llama3-70b",
         "tp_comm_overlap=1 overlaps tensor-parallel communication, and tp=1 has none"),
        (Layout(dp=64, cp_kind="allgather"), "llama3-70b",
         "cp_kind=allgather chooses how context-parallel attention communicates, and cp=1 "
         "has none"),
        (Layout(dp=8, tp=8, moe_tp="experts", sequence_parallel=True), "llama3-70b",
         "moe_tp=experts splits mixture-of-experts blocks over tp, and llama3-70b has none"),
    )
    for layout, model, says in cases:
        reasons = evaluate_layout(model, 64, layout).reasons
        assert any(k == CONSTRAINT and says in r for k, r in reasons), (layout, reasons)
    assert main([*H200_70B, "--layout", "dp=64 tp_comm_overlap=true"]) == 2
    assert "tp=1 has none; set tp > 1 or drop tp_comm_overlap" in capsys.readouterr().err


def test_pinned_cp_kind_searches_context_parallel_layouts(capsys):
    import json

    assert main([*H200_70B, "--fix", "cp_kind=allgather", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and all(r["degrees"]["cp"] > 1 and r["degrees"]["cp_kind"] == "allgather"
                          for r in ranked)
