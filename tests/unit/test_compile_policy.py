"""train.compile: which layouts each mode takes, and what happens without a toolchain.

Nothing here compiles: the toolchain probe is replaced by a stand-in, so these checks
run in milliseconds (the compiled runs themselves are in tests/dist/test_compile_parity).
"""

from __future__ import annotations

import pytest
import torch

from partita.compile import (
    CompilePolicy,
    model_refusal,
    resolve_mode,
)
from partita.errors import PartitaError
from partita.layout import Layout
from partita.models.catalog import get_model_config
from partita.parallelize import check_layout
from partita.testing import parity_config

CPU = torch.device("cpu")


def works(_device: str) -> None:
    return None


def broken(_device: str) -> str:
    return "CalledProcessError: g++ not found"


def test_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(PartitaError, match="none, blocks, model, auto"):
        CompilePolicy("fast")
    with pytest.raises(PartitaError, match="train.compile"):
        parity_config(train=dict(compile="fast"))


def test_model_mode_names_what_stands_in_its_way():
    assert model_refusal(Layout(dp=2, zero_stage=1)) is None
    text = model_refusal(Layout(dp=2, zero_stage=3, recompute="full", tp=2))
    assert "ZeRO-3" in text and "recomputation" in text and "compile=blocks" in text
    assert "context parallelism" in model_refusal(Layout(cp=2))


def test_model_mode_takes_zero3_over_one_rank():
    # A ZeRO group of one rank runs every stage as 0: no gathers in hooks to refuse.
    assert model_refusal(Layout(zero_stage=3)) is None
    assert model_refusal(Layout(tp=2, zero_stage=3)) is None
    assert "ZeRO-3" in model_refusal(Layout(dp=2, zero_stage=3))
    assert "ZeRO-3" in model_refusal(Layout(cp=2, zero_stage=3))


def test_a_broken_compiler_is_quoted_not_just_named():
    from partita.compile import _compiler_complaint

    exc = RuntimeError("backend='once_per_machine' raised:\nCppCompileError: C++ compile "
                       "error\n\nCommand:\ng++ /tmp/x.cpp -shared -o /tmp/x.so\n\nOutput:\n"
                       "g++: fatal error: no input files\ncompilation terminated.")
    said = _compiler_complaint(exc)
    assert said.startswith("backend='once_per_machine' raised:")
    assert "g++: fatal error: no input files" in said and "C++ compile error" in said
    assert _compiler_complaint(RuntimeError("")) == "no message"


def test_recompilations_are_read_from_dynamos_cache():
    # torch's own "recompiles" counter is never filled in recent releases: a compiled
    # function run again without autograd (a new version) must still count as one.
    from partita import compile as compiled_code

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    before = compiled_code.compile_counts()["recompiles"]
    compiled_code._COMPILED_CODE.add(double.__code__)
    try:
        run = torch.compile(double, backend="eager")
        x = torch.ones(3, requires_grad=True)
        run(x)
        assert compiled_code.compile_counts()["recompiles"] == before
        with torch.no_grad():
            run(x)
        assert compiled_code.compile_counts()["recompiles"] == before + 1
    finally:
        compiled_code._COMPILED_CODE.discard(double.__code__)


def test_break_reasons_name_partitas_eager_calls_without_addresses():
    from torch._dynamo.utils import counters

    from partita.compile import break_reasons

    key = ("Skip inlining function <function EagerOnly.__call__ at 0x7f3a9c1d2e80> since "
           "it was wrapped with torch.compiler.disable")
    counters["graph_break"][key] += 2
    try:
        (said,) = [r for r in break_reasons() if "eager-only" in r]
    finally:
        del counters["graph_break"][key]
    assert "0x" not in said and said.endswith("(2x)")
    assert "tensor- or context-parallel exchange, or the expert dispatch" in said


def test_model_mode_takes_recomputation_that_traces_whole():
    # A dense block, or any attention core, is a checkpoint region of the compiled model.
    for layout in (Layout(dp=2, recompute="full"), Layout(dp=2, recompute="selective"),
                   Layout(tp=2, sequence_parallel=True, recompute="selective")):
        assert model_refusal(layout) is None
    assert model_refusal(Layout(dp=2, ep=2, recompute="selective"), moe=True) is None
    # A whole block with eager pieces inside is not.
    text = model_refusal(Layout(tp=2, recompute="full"))
    assert "tensor parallelism's collectives" in text and "recompute=selective" in text
    assert "expert dispatch" in model_refusal(Layout(dp=2, recompute="full"), moe=True)
    assert model_refusal(Layout(dp=2, recompute="full"), moe=False) is None
    with pytest.raises(PartitaError, match="expert dispatch"):
        resolve_mode(CompilePolicy("model"), Layout(dp=2, recompute="full"), CPU, works,
                     moe=True)
    with pytest.raises(PartitaError, match="ZeRO-3"):
        resolve_mode(CompilePolicy("model"), Layout(dp=2, zero_stage=3), CPU, works)


def test_blocks_take_every_layout():
    for layout in (Layout(dp=2, zero_stage=3), Layout(tp=2, sequence_parallel=True),
                   Layout(dp=2, recompute="full"), Layout(pp=2, schedule="zb-h1"),
                   Layout(cp=2), Layout(dp=2, cp=2, zero_stage=3),
                   Layout(cp=2, cp_kind="allgather", tp=2, sequence_parallel=True)):
        assert resolve_mode(CompilePolicy("blocks"), layout, CPU, works) == ("blocks", "")
    assert resolve_mode(CompilePolicy("auto"), Layout(pp=2), CPU, works) == ("blocks", "")
    assert resolve_mode(CompilePolicy("auto"), Layout(cp=2), CPU, works) == ("blocks", "")
    with pytest.raises(PartitaError, match="pipeline"):  # `model` still cannot
        resolve_mode(CompilePolicy("model"), Layout(pp=2), CPU, works)
    with pytest.raises(PartitaError, match="context parallelism"):
        resolve_mode(CompilePolicy("model"), Layout(cp=2), CPU, works)
    check_layout(parity_config(parallel=dict(cp=2), train=dict(compile="blocks")),
                 get_model_config("tiny"), Layout(cp=2))


def test_mixture_of_experts_models_are_accepted():
    """Their dispatch runs eagerly between compiled pieces (partita.eager_only)."""
    assert resolve_mode(CompilePolicy("blocks"), Layout(dp=2, ep=2), CPU, works) == ("blocks", "")
    check_layout(parity_config(train=dict(compile="blocks")), get_model_config("tiny-moe"),
                 Layout())


def test_without_a_toolchain_auto_falls_back_and_explicit_modes_stop():
    mode, note = resolve_mode(CompilePolicy("auto"), Layout(dp=2), CPU, broken)
    assert mode == "none" and "g++ not found" in note and "eagerly" in note
    for explicit in ("blocks", "model"):
        with pytest.raises(PartitaError, match="g[+][+] not found.*compile=auto"):
            resolve_mode(CompilePolicy(explicit), Layout(dp=2), CPU, broken)
    assert resolve_mode(CompilePolicy("none"), Layout(pp=2), CPU, broken) == ("none", "")
    assert resolve_mode(CompilePolicy("auto"), Layout(dp=2), CPU, works) == ("blocks", "")


def test_compile_model_on_a_layout_it_cannot_take_is_refused_before_torch(tmp_path):
    """The refusal needs only the degrees; it came after torch was imported (seconds),
    and after the default world size was asked of torch, where it can come at once."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from partita.cli import main\n"
            "status = main(['train', '--nproc', '2', '--train.compile=model', "
            "'--parallel.zero_stage=3', "
            f"'--train.out_dir={tmp_path / 'run'}'])\n"
            "print(status, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["2", "False"], out.stderr
    assert "ZeRO-3 gathers each block's parameters" in out.stderr
    assert not (tmp_path / "run").exists()
