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
    "parallel.schedule", "parallel.offload_dir",
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


def test_every_parallel_value_out_of_range_is_named_before_any_layout_is_built():
    """`--parallel.tp=0` read "tp*pp*cp=0 does not divide the world size 2; start a
    multiple of 0 processes", and of two bad policies only the first was named (as
    "layout recompute='foo'")."""
    with pytest.raises(PartitaError) as exc:
        load_config(None, ["--parallel.tp=0", "--parallel.dp=-2", "--parallel.recompute=foo",
                           "--parallel.offload=bar"])
    text = str(exc.value)
    for part in ("parallel.tp=0", "parallel.dp=-2", "parallel.recompute='foo'",
                 "parallel.offload='bar'", "positive integer"):
        assert part in text
    assert "multiple of 0" not in text and "layout recompute" not in text
    cfg = Config()
    cfg.parallel.pp = 0  # a Config built in code, never loaded: the layout checks too
    with pytest.raises(PartitaError, match="parallel.pp=0 is out of range: use a positive"):
        cfg.layout(2)


def test_float16_parameters_without_master_weights_are_refused():
    """They diverged silently (loss 5.5 -> 13, infinite gradient norms) and exited 0."""
    for dtype in ("--precision.param_dtype=fp16", "--train.dtype=float16"):
        with pytest.raises(PartitaError, match=r"master_weights=false with .*16.*"
                                               r"master_weights=\s?true.*bfloat16"):
            load_config(None, [dtype, "--precision.master_weights=false"])
    load_config(None, ["--precision.param_dtype=bf16", "--precision.master_weights=false"])
    load_config(None, ["--precision.param_dtype=fp16"])


def test_timeouts_and_seeds_have_an_upper_bound():
    """1e30 s overflowed gloo's timeout in every worker, and a seed of 2**64 - 1
    overflowed torch.manual_seed(seed + rank), both after launch."""
    with pytest.raises(PartitaError) as exc:
        load_config(None, ["--train.collective_timeout_s=1e30", "--parallel.pp_timeout_s=1e30",
                           "--data.seed=4294967296", "--model.seed=4294967296"])
    for key in ("train.collective_timeout_s", "parallel.pp_timeout_s", "data.seed",
                "model.seed"):
        assert key in str(exc.value)
    assert "<= 4294967295" in str(exc.value)  # written in full, not 4.29497e+09
    with pytest.raises(PartitaError, match="data.seed.*too large"):
        load_config(None, ["--data.seed=18446744073709551615"])


def test_a_sequence_longer_than_the_models_positions_is_refused():
    """model.max_seq_len=64 with data.seq_len=128 quietly built 128 positions."""
    with pytest.raises(PartitaError, match="data.seq_len=128 exceeds model.max_seq_len=64"):
        load_config(None, ["--model.max_seq_len=64", "--data.seq_len=128"])
    assert load_config(None, ["--data.seq_len=512"]).model_config().max_seq_len >= 512
