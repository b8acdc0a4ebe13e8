"""A plan's layouts can be fed back: the text it prints and the JSON degrees it gives
are accepted by --layout and evaluate to the same layout and step time."""

import json

import pytest

from partita.cli import main

SEARCHES = [
    (["--model", "llama3-70b", "--gpus", "64"], []),
    (["--model", "mixtral-8x7b", "--gpus", "32"], ["--fix", "tp=2"]),
    (["--model", "llama3-8b", "--gpus", "16"], ["--fix", "sequence_parallel=false,tp=2"]),
    (["--model", "llama3-8b", "--gpus", "16"], ["--all-options"]),
    (["--model", "llama3-8b", "--gpus", "8"], ["--fix", "schedule=1f1b,pp=1"]),
]


def _json(capsys, argv: list[str]) -> dict:
    assert main(["plan", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _degrees_text(degrees: dict) -> str:
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in degrees.items())


@pytest.mark.parametrize("request_args, search_args", SEARCHES)
def test_top_layouts_round_trip_through_layout(capsys, request_args, search_args):
    ranked = _json(capsys, [*request_args, *search_args, "--top", "3"])["ranked"]
    assert ranked
    for row in ranked:
        for text in (row["layout"], _degrees_text(row["degrees"])):
            again = _json(capsys, [*request_args, "--layout", text])["evaluation"]
            assert again["degrees"] == row["degrees"], text
            assert again["time"]["step_s"] == pytest.approx(row["time"]["step_s"], rel=1e-12)


def test_pipeline_schedule_at_pp1_is_accepted_only_as_the_default(capsys):
    base = ["--model", "llama3-8b", "--gpus", "8"]
    assert _json(capsys, [*base, "--layout", "dp=8 pp=1 schedule=1f1b"])["fits"] is not None
    assert main(["plan", *base, "--layout", "dp=8 pp=1 schedule=zb-h1"]) == 2
    assert "schedule=zb-h1 is a pipeline schedule, but pp=1 has no pipeline" in \
        capsys.readouterr().err
