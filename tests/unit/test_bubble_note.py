"""Before launch, a pipeline with too few microbatches for its stages gets a note with
a microbatch count that would idle less."""

from __future__ import annotations

from partita.commands.train_notes import bubble_note, compiled_zero_bubble_note
from partita.config import load_config


def _note(*overrides: str, world: int = 2) -> str | None:
    return bubble_note(load_config(None, ["--parallel.pp=2", *overrides]), world)


def test_one_microbatch_over_two_stages_is_noted_with_a_count_that_helps():
    note = _note("--train.global_batch=8", "--train.microbatches=1")
    assert note is not None and "idles about 40% of it" in note
    assert "train.microbatches=8 would bring it to 8%" in note


def test_enough_microbatches_or_no_pipeline_say_nothing():
    assert _note("--train.global_batch=8", "--train.microbatches=4") is None
    assert bubble_note(load_config(None, ["--train.microbatches=1"]), 2) is None


def test_a_batch_too_small_for_more_microbatches_says_what_would_help():
    note = _note("--train.global_batch=1", "--train.microbatches=1", world=2)
    assert note is not None and "allow no more microbatches" in note
    assert "a larger train.global_batch would" in note


def test_compiled_blocks_under_zero_bubble_point_to_1f1b():
    def note(*overrides):
        return compiled_zero_bubble_note(load_config(None, ["--parallel.pp=2", *overrides]))

    got = note("--parallel.schedule=zb-h1", "--train.compile=blocks")
    assert got is not None and "parallel.schedule=1f1b runs as fast" in got
    assert note("--parallel.schedule=1f1b", "--train.compile=blocks") is None
    assert note("--parallel.schedule=zb-h1") is None  # eager: W is deferred
    # fully recomputed blocks rerun from W, which they do defer
    assert note("--parallel.schedule=zb-h1", "--train.compile=blocks",
                "--parallel.recompute=full") is None
