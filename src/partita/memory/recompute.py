"""Activation recomputation: keep less for backward, run forward again to get it back.

    policy = RecomputePolicy("full", layers=0)       # or "selective"; layers=K: first K
    report = apply_recompute(model, plan, policy)    # blocks of this rank's stage(s)

Full: a block runs its forward without recording a graph and keeps only its input (and
the random-number states its dropouts drew from); backward runs the forward again, this
time recording, and differentiates that. Selective (Korthikanti et al. 2022): only the
attention core (scores, softmax, dropout on them, the product with V) is rerun; the
projections, norms and MLP keep what they saved. The model names its attention core in
its plan (the `ATTENTION_CORE` role): a parameter-free module called as core(q, k, v).

Both are one autograd function, `_Recomputed`, wrapped around a module's forward. Its
inputs are the tensors of the call and the module's parameters, so the graph has an
edge from it to every parameter. That is what makes it compose:

- ZeRO-3 gathers a block around its forward and again when backward reaches its output
  (`zero.param_gather`); the rerun happens inside that second gather, and the engine
  frees the unit when the parameter gradients this function returns have arrived.
- A zero-bubble pipeline splits backward into I (input gradient) and W (weight
  gradients) along the graph (`pipeline.backward`): this function is the node on the
  input path whose edges lead to the block's parameters, so I calls it asking for the
  input gradient only and W re-enters it asking for the parameters only. Each pass
  reruns the forward and computes only what the engine will use (autograd tells which
  edges it executes); W reruns from the block's input, which is all it keeps.
- Dropout: the states of every generator the module's dropouts draw from (torch's
  default generators and tensor parallelism's region generators) are recorded before
  the first forward and restored around each rerun, so the rerun draws the same masks;
  the generators are put back afterwards, so later forwards draw what they would have.
- Side effects: a module whose forward records something besides its output (an MoE
  feed-forward sums its routing statistics and auxiliary losses for the log) has a
  `recompute_pass(name)` method; it is told "forward" around the first forward (run
  without a graph, but a training forward all the same) and "rerun" around each
  rerun, then None, so it records once per forward however often backward reruns it
  (a split backward reruns twice). Collectives inside the module (the ring of context
  parallelism, the all-to-alls of expert parallelism) run again in each rerun, on
  every rank of their group at the same point of the same backward.
- Selective under context parallelism: context parallelism's core keeps no scores
  (only its output and a log-sum-exp per query, see `context_parallel.blocks`), so it
  says `saves_scores = False` and selective leaves it alone: rerunning it would repeat
  the key/value exchange to drop one output-sized tensor.
- Compiled blocks (`train.compile=blocks`): full recompute wraps the compiled forward,
  so `_Recomputed` stays outside the graph; selective's core is inside it, where the
  recomputed class hands the core to torch's checkpoint instead (`_recomputed_class`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.autograd.graph import get_gradient_edge

from partita.errors import PartitaError
from partita.models import plan as roles

MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class RecomputePolicy:
    """What to recompute: `mode` one of MODES; `layers` K > 0: only the first K blocks
    of each pipeline stage this rank holds (0: all of them)."""

    mode: str = "none"
    layers: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PartitaError(f"recompute={self.mode!r} is unknown; choose one of "
                               f"{', '.join(MODES)}.")
        if self.layers < 0:
            raise PartitaError(f"recompute_layers={self.layers} must be 0 or more.")


@dataclass
class RecomputeReport:
    """Which modules rerun their forward in backward (names as in the model)."""

    mode: str
    modules: list[str]


class _RNGState:
    """The states of the generators a module's forward may draw from."""

    def __init__(self, owners: list[nn.Module], device: torch.device) -> None:
        self.device = device
        # A module that draws from a generator of its own (tensor parallelism's
        # ParallelDropout) names it through `generator(device)`: `owners` (see
        # `generator_owners`).
        self.generators = [m.generator(device) for m in owners]
        self.states = self.read()

    def read(self) -> list[torch.Tensor]:
        states = [torch.get_rng_state()]
        if self.device.type == "cuda":
            states.append(torch.cuda.get_rng_state(self.device))
        return states + [g.get_state() for g in self.generators]

    def write(self, states: list[torch.Tensor]) -> None:
        torch.set_rng_state(states[0])
        rest = states[1:]
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(rest[0], self.device)
            rest = rest[1:]
        for g, s in zip(self.generators, rest):
            g.set_state(s)


class _NoRNG:
    """The generator states of a module that draws no random numbers: none to keep.
    (Reading torch's would also break a compiled block's graph at every call.)"""

    states: list[torch.Tensor] = []

    def read(self) -> list[torch.Tensor]:
        return []

    def write(self, states: list[torch.Tensor]) -> None:
        pass


NO_RNG = _NoRNG()


def draws_random_numbers(module: nn.Module) -> bool:
    """Whether `module`'s forward may draw random numbers. False only when every
    submodule is partita's or torch.nn's own, whose only draws are their dropouts, and
    each of those has p = 0; any other module (a Hugging Face attention's dropout, say)
    is taken to draw."""
    for m in module.modules():
        if not type(m).__module__.startswith(("partita.", "torch.nn.")):
            return True
        if getattr(m, "p", 0) and (isinstance(m, nn.modules.dropout._DropoutNd)
                                   or callable(getattr(m, "generator", None))):
            return True
    return False


def generator_owners(module: nn.Module) -> list[nn.Module]:
    """The submodules of `module` that draw from a generator of their own."""
    return [m for m in module.modules() if callable(getattr(m, "generator", None))]


class _Passes:
    """The modules of a recomputed module that want to know which pass runs (see the
    module docstring: `recompute_pass`)."""

    def __init__(self, module: nn.Module) -> None:
        self.modules = [m for m in module.modules()
                        if callable(getattr(m, "recompute_pass", None))]

    @contextmanager
    def running(self, name: str) -> Iterator[None]:
        for m in self.modules:
            m.recompute_pass(name)
        try:
            yield
        finally:
            for m in self.modules:
                m.recompute_pass(None)


def _alias(t: torch.Tensor) -> torch.Tensor:
    return t.view_as(t) if t.requires_grad else t


def _node(t: torch.Tensor):
    return get_gradient_edge(t).node if t.requires_grad else None


class _Recomputed(torch.autograd.Function):
    """forward(run, rng, passes, params, n, *inputs, *edges) -> run(*inputs), keeping
    `inputs`.

    `params` are the module's parameters, which the rerun differentiates; `edges` are
    aliases of them (one view each), the function's inputs through which their
    gradients leave. Aliases of the inputs and parameters, not the tensors themselves,
    because autograd can say whether it will run a node of the graph but not, inside
    `torch.autograd.grad`, whether it will capture a leaf's gradient."""

    @staticmethod
    def forward(ctx, run, rng: _RNGState | _NoRNG, passes: _Passes, params: list[torch.Tensor],
                n_inputs: int, *tensors):
        inputs = tensors[:n_inputs]
        ctx.run, ctx.rng, ctx.passes, ctx.params = run, rng, passes, params
        ctx.save_for_backward(*inputs)
        # Which of our edges autograd will run in a given backward (see `backward`).
        ctx.nodes = [_node(t) for t in tensors]
        with torch.no_grad(), passes.running("forward"):
            out = run(*inputs)
        ctx.is_tuple = isinstance(out, tuple)
        return out

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        # I of a split backward asks for the input gradient only, W for the parameters'
        # only; a whole backward for both. Compute just what this pass executes.
        wanted = [node is not None and torch._C._will_engine_execute_node(node)
                  for node in ctx.nodes]
        skip = (None,) * 5
        if not any(wanted):
            return skip + (None,) * len(wanted)
        now = ctx.rng.read()
        ctx.rng.write(ctx.rng.states)
        try:
            with torch.enable_grad(), ctx.passes.running("rerun"):
                detached = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
                out = ctx.run(*detached)
        finally:
            ctx.rng.write(now)
        outs = out if ctx.is_tuple else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        targets = [t for t, w in zip(list(detached) + list(ctx.params), wanted) if w]
        found = iter(torch.autograd.grad([o for o, _ in pairs], targets,
                                         [g for _, g in pairs], allow_unused=True)
                     if pairs else [None] * len(targets))
        return skip + tuple(next(found) if w else None for w in wanted)


class RecomputedForward:
    """The original forward, under `_Recomputed` while autograd records (eager code; see
    `_recomputed_class`). Tensor positional arguments are differentiated; keyword arguments
    and other positional ones are passed through as constants."""

    def __init__(self, module: nn.Module, forward: Callable) -> None:
        self.module, self.forward = module, forward
        # Found at the first call, once every layout has placed its modules, and kept:
        # walking the submodules at every call cost a block ~0.2 ms on CPU.
        self.passes: _Passes | None = None
        self.rng_owners: list[nn.Module] = []
        self.random = True

    def __call__(self, *args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not torch.is_grad_enabled() or not tensors:
            return self.forward(*args, **kwargs)
        for v in kwargs.values():
            if isinstance(v, torch.Tensor) and v.requires_grad:
                raise PartitaError(
                    f"recompute of {type(self.module).__name__}: keyword argument tensors "
                    "that require gradients are not supported; pass them positionally.")
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def run(*xs):
            full = list(args)
            for i, x in zip(slots, xs):
                full[i] = x
            return self.forward(*full, **kwargs)

        if self.passes is None:
            self.passes, self.rng_owners = _Passes(self.module), generator_owners(self.module)
            self.random = draws_random_numbers(self.module)
        params = [p for p in self.module.parameters() if p.requires_grad]
        rng = _RNGState(self.rng_owners, tensors[0].device) if self.random else NO_RNG
        edges = [_alias(t) for t in tensors] + [p.view_as(p) for p in params]
        return _Recomputed.apply(run, rng, self.passes, params, len(tensors), *edges)


@functools.cache
def _recomputed_class(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` with a forward that reruns in backward: the class a recomputed module is
    given (one per original class, so blocks share it).

    A class, not a `forward` set on each module, because dynamo guards on the identity
    of an object a module holds as its own `forward`: compiled blocks whose cores each
    had their own would each compile a graph of their own. Inside a compiled block
    (selective recompute: the attention core, which records nothing per pass) dynamo
    cannot trace `_Recomputed`, which reads autograd's nodes, and would break the
    block's graph at each call; torch's own checkpoint it traces as a region whose
    operations the compiler's partitioner reruns in the block's backward (an operation
    that may draw, such as the attention kernel with its dropout argument, from a
    generator state it saves in forward). The block's backward is one compiled node, which a
    split backward runs whole (`pipeline.backward.runs_whole`), so the pass need not be
    known there. Eager code goes through the module's `RecomputedForward`."""
    original = cls.forward

    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return self.recomputed_forward(*args, **kwargs)
        if not torch.is_grad_enabled():
            return original(self, *args, **kwargs)
        return torch.utils.checkpoint.checkpoint(functools.partial(original, self), *args,
                                                 use_reentrant=False, **kwargs)

    # The original's module name: `draws_random_numbers` judges a module by it.
    return type(f"Recomputed{cls.__name__}", (cls,),
                {"forward": forward, "__module__": cls.__module__})


def recompute_module(module: nn.Module) -> None:
    """Make `module` rerun its forward in backward (idempotent). A `forward` set on the
    module itself (a compiled one, when full recompute wraps a compiled block) moves
    into its `RecomputedForward`."""
    if "recomputed_forward" in module.__dict__:
        return
    inner = module.__dict__.pop("forward", None) or functools.partial(type(module).forward,
                                                                      module)
    module.recomputed_forward = RecomputedForward(module, inner)
    module.__class__ = _recomputed_class(type(module))


def _stage_blocks(model: nn.Module, plan: roles.ModelPlan) -> list[tuple[str, nn.Module]]:
    container = model.get_submodule(plan.blocks)
    return [(f"{plan.blocks}.{k}", m) for k, m in container.items()]


def apply_recompute(model: nn.Module, plan: roles.ModelPlan,
                    policy: RecomputePolicy) -> RecomputeReport:
    """Wrap the blocks (full) or their attention cores (selective) that `policy` names.

    `model` holds this rank's blocks only (after the pipeline cut), so "the first K
    blocks of each stage" are its first K blocks."""
    if policy.mode == "none":
        return RecomputeReport("none", [])
    blocks = _stage_blocks(model, plan)
    if not blocks and not any(True for _ in model.get_submodule(plan.blocks).children()):
        raise PartitaError(
            f"recompute={policy.mode}: the model has no blocks under '{plan.blocks}' to "
            "recompute; use recompute=none.")
    if policy.layers:
        blocks = blocks[:policy.layers]
    chosen: list[tuple[str, nn.Module]] = []
    if policy.mode == "full":
        chosen = blocks
    else:
        for name, block in blocks:
            cores = [(f"{name}.{n}", m) for n, m in block.named_modules()
                     if n and plan.role_of(f"{name}.{n}") == roles.ATTENTION_CORE]
            if not cores:
                raise PartitaError(
                    f"recompute=selective reruns the attention core, but the model's plan "
                    f"names none in {name} (the '{roles.ATTENTION_CORE}' role). Add it to "
                    "the plan, or use recompute=full.")
            # A core that keeps no scores has nothing for selective to drop.
            chosen += [(n, m) for n, m in cores if getattr(m, "saves_scores", True)]
    for _, module in chosen:
        recompute_module(module)
    return RecomputeReport(policy.mode, [n for n, _ in chosen])
