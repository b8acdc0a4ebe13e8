"""Every run setting out of its range is refused when the configuration is loaded.

Cases are generated from the range table itself (values just outside each range, and a
value of the wrong type), so a setting added to the table is tested without a new line
here; a second test makes sure every numeric setting has a range at all.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from partita.config import Config, _sections, load_config
from partita.config_ranges import RANGES, out_of_range
from partita.errors import PartitaError

pytestmark = pytest.mark.fault_suite("settings")

# Settings that belong to the layout (validated with the model and world in view) or
# are free text.
LAYOUT_OR_TEXT = {
    "parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep",
    "parallel.zero_stage", "parallel.virtual_stages", "parallel.schedule",
    "parallel.recompute", "parallel.recompute_layers", "parallel.offload",
    "parallel.offload_dir",
    "model.name", "data.source", "data.cache_dir", "train.out_dir", "train.timeline_png",
    "train.checkpoint_dir", "train.resume",
    "model.init_from", "data.tokenizer", "data.text_field", "data.mix",
}


def _outside_cases() -> list[tuple[str, object]]:
    return [(key, value) for key, rule in RANGES.items() for value in rule.outside]


def _wrong_type_cases() -> list[tuple[str, str]]:
    """Every numeric setting given a word, every true/false setting given 'maybe'."""
    cases = []
    for section, cls in _sections().items():
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            kinds = (hint, *typing.get_args(hint))
            if bool in kinds:
                cases.append((f"{section}.{f.name}", "maybe"))
            elif int in kinds or float in kinds:
                cases.append((f"{section}.{f.name}", "twelve"))
    return cases


@pytest.mark.parametrize(("key", "value"), _outside_cases())
def test_value_just_outside_its_range_is_refused(key, value):
    with pytest.raises(PartitaError) as exc:
        load_config(None, [f"--{key}={value}"])
    assert key in str(exc.value)
    assert "out of range" in str(exc.value)


@pytest.mark.parametrize(("key", "value"), _wrong_type_cases())
def test_value_of_the_wrong_type_is_refused(key, value):
    with pytest.raises(PartitaError) as exc:
        load_config(None, [f"--{key}={value}"])
    assert key in str(exc.value)


def test_defaults_are_in_range():
    assert out_of_range(Config()) == []


def test_every_problem_is_reported_at_once():
    with pytest.raises(PartitaError) as exc:
        load_config(None, ["--train.steps=0", "--train.lr=-1", "--train.beta1=1.5"])
    for key in ("train.steps", "train.lr", "train.beta1"):
        assert key in str(exc.value)


def test_nan_and_infinity_are_named_as_such():
    with pytest.raises(PartitaError) as exc:
        load_config(None, ["--train.lr=nan", "--train.grad_clip=inf"])
    assert "train.lr=nan is not a finite number" in str(exc.value)
    assert "train.grad_clip=inf is not a finite number" in str(exc.value)


def test_min_lr_above_lr_is_refused():
    with pytest.raises(PartitaError, match="train.min_lr"):
        load_config(None, ["--train.lr=1e-4", "--train.min_lr=1e-3"])


def test_every_numeric_or_enumerated_setting_has_a_range():
    missing = []
    for section, cls in _sections().items():
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            hint = typing.get_type_hints(cls)[f.name]
            if key in LAYOUT_OR_TEXT or hint is bool or bool in typing.get_args(hint):
                continue
            if key not in RANGES:
                missing.append(key)
    assert not missing, f"settings without a valid range in config_ranges.RANGES: {missing}"


@pytest.mark.fault_suite("settings")
def test_disk_offload_without_a_folder_says_which_setting_to_give():
    """An unset parallel.offload_dir was reported as "'' is not an existing directory ...
    Create it": there is nothing to create; the message names the setting to give."""
    from partita.memory.disk import check_offload_dir

    with pytest.raises(PartitaError, match=r"parallel.offload_dir, which is not set: give a "
                                           r"folder .* --parallel.offload_dir="):
        check_offload_dir("", 1 << 20)
