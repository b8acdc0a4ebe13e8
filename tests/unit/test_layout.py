"""partita.layout: one Layout, its text form and old spellings, and every rule of validate."""

import subprocess
import sys
import warnings

import pytest

from partita.config import Config, layout_overrides, load_config
from partita.errors import PartitaError
from partita.layout import Layout, parse_layout
from partita.layout_rules import (
    CONSTRAINT,
    DIVISIBILITY,
    UNAVAILABLE,
    ZERO3_PIPELINE_REASON,
    find_problems,
    validate,
)
from partita.models.catalog import get_model_config
from partita.models.model_config import ModelConfig

TINY = get_model_config("tiny")  # 4 layers, 4 heads, 2 kv heads, vocab 256


def _problems(layout: Layout, world: int | None = None, model: ModelConfig = TINY,
              seq_len: int = 128, global_batch: int = 16):
    return find_problems(layout, model, layout.world_size if world is None else world,
                         seq_len=seq_len, global_batch=global_batch)


def test_layout_modules_import_no_torch():
    code = "import sys, partita.layout, partita.layout_rules; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_text_form_round_trips():
    lay = Layout(dp=2, tp=2, pp=2, zero_stage=1, schedule="interleaved-1f1b",
                 virtual_stages=2, microbatch_size=2, sequence_parallel=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the canonical names raise no deprecation
        assert parse_layout(lay.describe()) == lay
    assert parse_layout("tp=2 pp=2", 8) == Layout(dp=2, tp=2, pp=2, sequence_parallel=True)
    assert parse_layout("pp=2 virtual_stages=2", 2).schedule == "interleaved-1f1b"


def test_text_form_names_the_overlap_options_that_are_not_partitas():
    """The overlap options change the planner's prediction; the text form left them out,
    so a layout printed by the planner read back as another one."""
    lay = Layout(dp=2, tp=2, sequence_parallel=True, tp_comm_overlap=True,
                 overlap_grad_reduce=False)
    assert lay.describe().endswith("tp_comm_overlap=1 overlap_grad_reduce=0")
    assert parse_layout(lay.describe()) == lay
    assert "overlap" not in Layout(dp=2).describe()


@pytest.mark.parametrize("old,new", [
    ("zero=2", dict(zero_stage=2)),
    ("vpp=2 pp=2", dict(virtual_stages=2, pp=2, schedule="interleaved-1f1b")),
    ("mb=4", dict(microbatch_size=4)),
    ("sp=0 tp=2", dict(sequence_parallel=False, tp=2)),
    ("pp=2 schedule=interleaved", dict(pp=2, schedule="interleaved-1f1b")),
])
def test_old_planner_spellings_warn_and_still_work(old, new):
    with pytest.warns(FutureWarning, match="deprecated; write"):
        lay = parse_layout(old)
    for key, value in new.items():
        assert getattr(lay, key) == value


def test_schedule_alias_in_the_config_warns_and_resolves():
    cfg = load_config(overrides=["--parallel.pp=2", "--parallel.schedule=interleaved",
                                 "--train.microbatches=4"])
    with pytest.warns(FutureWarning, match="'interleaved-1f1b'"):
        lay = cfg.layout(2)
    assert lay.schedule == "interleaved-1f1b" and lay.virtual_stages == 2


def test_bad_values_name_the_key():
    with pytest.raises(PartitaError, match="name=value"):
        parse_layout("dp:2")
    # A right name without its value is told so, not offered itself as a correction.
    with pytest.raises(PartitaError, match="Give 'tp' a value: tp=VALUE") as caught:
        parse_layout("dp=2 tp")
    assert "Did you mean" not in str(caught.value)
    with pytest.raises(PartitaError, match="Did you mean 'tp'"):
        parse_layout("tq=2")
    with pytest.raises(PartitaError, match="recompute"):
        parse_layout("recompute=some")
    with pytest.raises(PartitaError, match="zero_stage"):
        Layout(zero_stage=4)
    with pytest.raises(PartitaError, match="unknown pipeline schedule"):
        Layout(schedule="1f1bb")
    with pytest.raises(PartitaError, match="positive integer"):
        Layout(tp=0)


def test_config_converts_to_a_layout_and_back():
    cfg = load_config(overrides=["--parallel.tp=2", "--parallel.pp=2",
                                 "--parallel.zero_stage=1", "--parallel.sequence_parallel",
                                 "--train.global_batch=16", "--train.microbatches=4"])
    lay = cfg.layout(8)
    assert lay == Layout(dp=2, tp=2, pp=2, zero_stage=1, microbatch_size=2,
                         sequence_parallel=True)
    assert lay.microbatches(16) == 4
    again = load_config(overrides=layout_overrides(lay, 16)).layout(8)
    assert again == lay


def test_config_batch_that_does_not_divide_says_what_to_change():
    cfg = Config()
    cfg.train.global_batch, cfg.train.microbatches = 12, 1
    with pytest.raises(PartitaError, match="multiple of 8"):
        cfg.layout(8)
    cfg.train.global_batch, cfg.train.microbatches = 16, 3
    with pytest.raises(PartitaError, match="divisor of 8"):
        cfg.layout(2)


def test_a_good_layout_has_no_problems():
    for lay in (Layout(), Layout(dp=2, zero_stage=3), Layout(tp=4, sequence_parallel=True),
                Layout(pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                       microbatch_size=8),
                Layout(dp=2, tp=2, pp=2, zero_stage=2, schedule="zb-h1"),
                Layout(cp=4), Layout(dp=2, cp=2, tp=2, zero_stage=3, sequence_parallel=True),
                Layout(cp=2, recompute="full"), Layout(cp=2, recompute="selective")):
        assert _problems(lay) == [], lay
        validate(lay, TINY, lay.world_size, seq_len=128, global_batch=16)


@pytest.mark.parametrize("layout,kind,text", [
    (Layout(tp=2, tp_comm_overlap=True), UNAVAILABLE, "is not available yet"),
    (Layout(cp=3), DIVISIBILITY, "not divisible by 2*cp=6"),
    (Layout(cp=128), DIVISIBILITY, "use cp <= 64"),
    (Layout(cp=2, tp=3, sequence_parallel=True), DIVISIBILITY, "multiple of 12"),
    (Layout(ep=2, dp=2), CONSTRAINT, "has no MoE blocks"),
    (Layout(recompute_layers=1), CONSTRAINT, "recomputes nothing"),
    (Layout(offload="optimizer+params", zero_stage=2), CONSTRAINT, "has none"),
    (Layout(tp=3), DIVISIBILITY, "n_heads=4 is not divisible by tp=3"),
    (Layout(sequence_parallel=True), CONSTRAINT, "parallel.tp=1"),
    (Layout(pp=8), DIVISIBILITY, "every stage needs at least one block"),
    (Layout(pp=2, schedule="interleaved-1f1b", virtual_stages=3), DIVISIBILITY, "6 pipeline"),
    (Layout(pp=2, virtual_stages=2), CONSTRAINT, "one stage per rank"),
    (Layout(virtual_stages=2, schedule="interleaved-1f1b"), CONSTRAINT, "needs a pipeline"),
    (Layout(pp=2, zero_stage=3), CONSTRAINT, "ZeRO stage 3 with pipeline"),
    (Layout(dp=3), DIVISIBILITY, "global_batch=16 is not divisible by the 3"),
    (Layout(dp=2, microbatch_size=3), DIVISIBILITY, "batch of 8 sequences"),
    (Layout(pp=4, schedule="interleaved-1f1b", virtual_stages=1, microbatch_size=8),
     CONSTRAINT, "multiple of 4; got 2"),
    (Layout(pp=2, schedule="interleaved-1f1b", virtual_stages=1), CONSTRAINT,
     "virtual_stages=1 has nothing to interleave"),
])
def test_each_rule_gives_its_reason(layout, kind, text):
    problems = _problems(layout)
    assert any(p.kind == kind and text in p.message for p in problems), problems


def test_tensor_parallel_rules_read_the_model():
    odd_vocab = ModelConfig(vocab_size=5, dim=64, n_layers=2, n_heads=8, max_seq_len=64)
    (problem,) = _problems(Layout(tp=4), model=odd_vocab, seq_len=64)
    assert "vocab_size=5 cannot be split over tp=4" in problem.message
    even = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=8, max_seq_len=64)
    (problem,) = _problems(Layout(tp=4, sequence_parallel=True), model=even, seq_len=30)
    assert "seq_len=30 is not divisible by tp=4" in problem.message


def test_world_size_mismatch_says_how_many_to_start():
    (problem,) = _problems(Layout(dp=2, tp=2), world=2)
    assert "needs 4 processes but 2 were started" in problem.message
    assert "--nproc 4" in problem.message
    assert "--parallel.dp=1 (or --parallel.dp=0" in problem.message  # 1 x 2 = 2: works
    # A dp change cannot fix tp x pp = 6 on 4 processes: said so, no dp suggested.
    (problem,) = _problems(Layout(dp=1, tp=2, pp=3), world=4)
    assert "tp x pp x cp = 6 does not divide 4, so change tp, pp or cp" in problem.message
    assert "--parallel.dp=1" not in problem.message


def test_validate_raises_every_reason_at_once():
    with pytest.raises(PartitaError) as info:
        validate(Layout(pp=2, zero_stage=3, cp=2, microbatch_size=3), TINY, 4, seq_len=130,
                 global_batch=16)
    text = str(info.value)
    assert "3 reasons" in text
    assert "context parallelism" in text and ZERO3_PIPELINE_REASON in text
    assert "microbatches of 3 sequences" in text
    assert "needs 4 processes" not in text  # cp*pp = 4 is the world
