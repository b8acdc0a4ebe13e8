"""Compiled training: `torch.compile` around the units the parallel layouts already cut.

    policy = CompilePolicy("blocks")                 # train.compile: none|blocks|model|auto
    mode = resolve_mode(policy, layout, device)      # "auto" -> "blocks" or "none"
    report = compile_blocks(model, plan)             # before recompute and the engine
    compile_model(dp.module, dp)                     # "model": after the engine

`blocks` compiles the forward of every transformer block, the unit ZeRO-3 gathers and
the pipeline cuts. Only `forward` is replaced, not the module's call, so the hooks the
engine puts on a block (ZeRO-3's gather and free, the pre-backward gather) run eagerly
around the compiled code and never break its graph. ZeRO 1-2 wait for the updated
parameters at each module that owns some; those waits move to the compiled unit's edge
(`ParamAllGather.regroup`). Tensor parallelism's collectives are autograd functions
around gloo or NCCL calls that dynamo cannot trace: they are marked with
`torch.compiler.disable` (`partita.eager_only`) before anything compiles, so each
is one deliberate graph break, compiled once, and a block is a few compiled pieces
between its collectives (the reasons are reported once).
A pipeline runs compiled blocks unchanged: its split backward computes a compiled
block's weight gradients together with its input gradient, since the block's backward
is one node that must run once (`partita.pipeline.backward.runs_whole`). An MoE
block's dispatch (data-dependent tokens per expert, the all-to-alls) is `EagerOnly`
too, and so is context parallelism's attention core (ring or all-gather: sends,
receives and waits between chunked attention pieces): the projections, rotary
embedding and everything after the core compile, the exchange runs eagerly between.

`model` compiles the whole local model in one piece, which needs a layout with nothing
that communicates inside the model's forward: no pipeline (the schedule drives the
stages), no ZeRO-3 (its gathers are hooks on every block), no context parallelism. A
recomputed block or attention core becomes a checkpoint region of the compiled graph,
rerun by the compiler in backward; only full recomputation of blocks that hold eager
pieces (tensor parallelism, mixture of experts) is refused. `model_refusal`
(`partita.compile_rules`, which the planner reads too) says which of those stands in
the way.

Blocks of one shape share one compiled graph: dynamo inlines the block's submodules and
takes their parameters as graph inputs, so the second block reuses the first one's code.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from partita.compile_once import once_per_machine
from partita.compile_rules import MODES, model_refusal
from partita.eager_only import keep_out_of_compiled_graphs
from partita.errors import PartitaError
from partita.layout import Layout
from partita.models.plan import ModelPlan


@dataclass(frozen=True)
class CompilePolicy:
    """`train.compile`: what to compile (one of MODES)."""

    mode: str = "none"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PartitaError(f"train.compile={self.mode!r} is unknown; choose one of "
                               f"{', '.join(MODES)}.")


@dataclass
class CompileReport:
    """What was compiled on this rank, and what the user should read once."""

    mode: str  # the mode in effect: none, blocks or model
    modules: list[str] = field(default_factory=list)
    note: str = ""  # a fallback or a limitation, said once at start


@functools.cache
def toolchain_problem(device_type: str) -> str | None:
    """Compile and run one tiny function with inductor on `device_type`; the error that
    stopped it, or None when the toolchain works (checked once per process)."""
    try:
        def probe(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.silu(x) * 2 + 1

        x = torch.arange(8.0, device=device_type)
        got = torch.compile(probe, backend=once_per_machine, fullgraph=True)(x)
        if not torch.allclose(got, probe(x)):
            return "the compiled probe computed a wrong result"
    except Exception as exc:  # any failure of the toolchain counts, whatever its type
        return f"{type(exc).__name__}: {_compiler_complaint(exc)}"
    global _probe_graphs
    _probe_graphs = compile_counts()["unique_graphs"]
    return None


_probe_graphs = 0  # graphs the toolchain probe compiled: not the model's, not reported


def _compiler_complaint(exc: Exception) -> str:
    """The lines of a failed compile that say why: the exception's first line and the
    compiler's own error lines (inductor wraps them deep in a long message, after the
    command it ran)."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    first = lines[0] if lines else ""
    errors = [x for x in lines[1:] if "error" in x.lower() and x != first][:3]
    said = "; ".join(x[:300] for x in [first, *errors] if x)
    return said or "no message"


def resolve_mode(policy: CompilePolicy, layout: Layout, device: torch.device,
                 probe: Callable[[str], str | None] = toolchain_problem, *,
                 moe: bool = False) -> tuple[str, str]:
    """(mode in effect, note): `auto` becomes `blocks` when the toolchain works and
    `none` (with the reason in the note) when it does not; `blocks` and `model` stop
    with the reason instead. `model` on a layout that cannot take it (`moe`: a model
    with mixture-of-experts blocks) stops too."""
    if policy.mode == "none":
        return "none", ""
    if policy.mode == "model":
        refusal = model_refusal(layout, moe)
        if refusal:
            raise PartitaError(refusal)
    problem = probe(device.type)
    if problem is None:
        return ("blocks" if policy.mode == "auto" else policy.mode), ""
    if policy.mode == "auto":
        return "none", (f"train.compile=auto: torch.compile does not work here ({problem});"
                        " training eagerly.")
    raise PartitaError(
        f"train.compile={policy.mode}: torch.compile does not work on this machine "
        f"({problem}). Install a working C++ compiler (CPU: inductor runs $CXX, else g++ "
        "or c++ from PATH) or Triton (CUDA), or use train.compile=auto to fall back to "
        "eager, or train.compile=none.")


def _compiled(fn: Callable) -> Callable:
    keep_out_of_compiled_graphs()  # collectives: deliberate breaks, never traced
    _COMPILED_CODE.add(getattr(fn, "__func__", fn).__code__)
    # Static shapes: a step's shapes never change; dynamic shapes would only add guards.
    # Inductor, with the ranks of one machine taking turns on identical graphs.
    return torch.compile(fn, dynamic=False, backend=once_per_machine)


def compile_blocks(model: nn.Module, plan: ModelPlan) -> CompileReport:
    """Compile the forward of each block this rank holds (after tensor parallelism,
    before recomputation wraps it and the engine hooks it)."""
    container = model.get_submodule(plan.blocks)
    compile_block_modules(list(container.values()))
    return CompileReport("blocks", [f"{plan.blocks}.{key}" for key in container])


def compile_block_modules(blocks: list[nn.Module]) -> None:
    """Replace each block's `forward` (not its call: hooks stay eager) by a compiled one."""
    for block in blocks:
        block.forward = _compiled(block.forward)


def compile_model(model: nn.Module) -> CompileReport:
    """Compile the whole local model's forward (`compile=model`; see `model_refusal`)."""
    model.forward = _compiled(model.forward)
    return CompileReport("model", [""])


def compiled_units(model: nn.Module, plan: ModelPlan, mode: str) -> list[nn.Module]:
    """The modules whose forward runs compiled: where waits for parameters belong."""
    if mode == "model":
        return [model]
    if mode == "blocks":
        return list(model.get_submodule(plan.blocks).values())
    return []


# Reading what dynamo did --------------------------------------------------------------

# The code objects partita compiled (a block class's forward, the model's): their
# dynamo cache entries beyond the first are recompilations.
_COMPILED_CODE: set = set()


def compile_counts() -> dict[str, int]:
    """Dynamo's process-wide counters (graphs, breaks) and the recompilations of what
    partita compiled: torch's own "recompiles" counter stays empty in recent releases,
    so they are read from dynamo's cache, one entry per compiled version of a code
    object (another grad mode, e.g. evaluation or a recomputed forward, or a shape)."""
    from torch._dynamo.utils import counters

    stats = counters["stats"]
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        recompiles = sum(max(0, len(_debug_get_cache_entry_list(code)) - 1)
                         for code in _COMPILED_CODE)
    except (ImportError, AttributeError):  # a torch without it: its counter, if any
        recompiles = int(sum(counters["recompiles"].values()))
    return {"unique_graphs": int(stats.get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": recompiles}


_EAGER_ONLY_CALL = re.compile(r"<function EagerOnly\.__call__ at 0x[0-9a-f]+>")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def break_reasons() -> list[str]:
    """Every distinct graph-break reason dynamo recorded in this process, most frequent
    first (reported once at the end of the first step, not per step)."""
    from torch._dynamo.utils import counters

    seen: Counter[str] = Counter()
    for reason, n in counters["graph_break"].items():
        lines = [x.strip() for x in str(reason).splitlines() if x.strip()]
        # Dynamo's first line names the kind; the "Explanation" line names the call.
        detail = next((x for x in lines if x.startswith("Explanation:")), "")
        said = " -- ".join(x for x in (lines[0] if lines else "", detail) if x)
        # partita's own breaks all go through EagerOnly's call: say what they are.
        said = _EAGER_ONLY_CALL.sub("partita's eager-only call (a tensor- or "
                                    "context-parallel exchange, or the expert dispatch)",
                                    said)
        seen[_ADDRESS.sub("", said)] += n
    return [f"{reason} ({n}x)" for reason, n in seen.most_common()]


def compile_summary(report: CompileReport) -> str:
    """One message after the first step: what compiled, and every graph-break reason
    once (a model that breaks in every block lists each reason once, with a count)."""
    counts = compile_counts()
    what = "each block" if report.mode == "blocks" else "the whole model"
    graphs = counts["unique_graphs"] - _probe_graphs
    line = (f"compile: {what} ({len(report.modules)} module(s)); {graphs}"
            f" graph(s), {counts['graph_breaks']} graph break(s), "
            f"{counts['recompiles']} recompilation(s)")
    if counts["recompiles"]:
        line += (" (versions for another grad mode or input shape, such as a recomputed "
                 "forward run without autograd: compiled once, not per step)")
    reasons = break_reasons()
    if reasons:
        line += ". Graph breaks (each compiled around once, not per step):\n  " + \
            "\n  ".join(reasons)
    return line
