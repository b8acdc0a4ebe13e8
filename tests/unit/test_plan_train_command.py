"""The `partita train` command a plan prints runs the plan: every layout field and the
precision it assumed."""

import dataclasses

from partita.cli import main
from partita.config import layout_overrides, load_config
from partita.layout import Layout

BATCH = 64


def test_every_layout_field_reaches_partita_train():
    # Every field away from its default (the check below fails on a new field left at
    # its default here, so that it is covered too).
    layout = Layout(dp=2, tp=2, pp=2, cp=2, ep=2, zero_stage=1, schedule="interleaved-1f1b",
                    virtual_stages=3, microbatch_size=2, sequence_parallel=True,
                    recompute="full", recompute_layers=1, offload="optimizer",
                    tp_comm_overlap=True, overlap_grad_reduce=False,
                    overlap_param_gather=False, cp_kind="allgather", moe_tp="experts")
    default = Layout()
    assert [f.name for f in dataclasses.fields(Layout)
            if getattr(layout, f.name) == getattr(default, f.name)] == []
    args = layout_overrides(layout, BATCH)
    assert {"--parallel.tp_comm_overlap=true", "--parallel.overlap_grad_reduce=false",
            "--parallel.overlap_param_gather=false"} <= set(args)
    assert load_config(overrides=args).layout(layout.world_size) == layout


def test_one_overlap_option_off_round_trips():
    for option in ("overlap_grad_reduce", "overlap_param_gather"):
        layout = Layout(dp=8, zero_stage=1, **{option: False})
        args = layout_overrides(layout, BATCH)
        assert f"--parallel.{option}=false" in args
        assert load_config(overrides=args).layout(8) == layout


def test_printed_command_carries_the_precision_and_overlap(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--precision",
                 "bf16-fp32-grads", "--fix", "overlap_grad_reduce=false"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("Train the first with:"))
    assert "--precision.param_dtype=bfloat16 --precision.reduce_dtype=float32" in line
    assert "--parallel.overlap_grad_reduce=false" in line
    assert "--parallel.overlap_param_gather" not in line  # left at train's default, on


def test_printed_command_carries_the_sequence_length(capsys):
    # The plan's batch counts sequences of its length: train's default (128) would run
    # another batch in tokens, and another memory.
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "4096"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("Train the first with:"))
    assert "--data.seq_len=4096" in line
