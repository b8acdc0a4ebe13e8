"""Which engine owns which parameter, and the misuses that knowledge catches.

A parameter belongs to at most one live `DataParallel`: two engines over the same
parameters (a module wrapped twice, or a block wrapped again inside a wrapped model)
would each hook its gradients and each rebind it to a flat buffer of their own, so one
engine's update never reaches the tensors the other computes with. `claim` refuses that
at construction; `DataParallel.close` gives the parameters back.

The same table lets a global `torch.optim` step hook refuse an optimizer that steps
parameters a sharding engine owns: at ZeRO 1-3 their `.grad` is not the reduced
gradient (stage 1: reduced only on the owned slice; stages 2-3: None, so the optimizer
silently skips them) and the engine's master weights would overwrite any update at its
next step. The hook costs partita's own step nothing, and a torch optimizer one
dictionary lookup per step once it has been checked against the current engines.

`state_dict_hooks` catches the other way of reading parameters the engine keeps
elsewhere: a state dict read right after step() (stages 1-2) or outside
gathered_parameters() (stage 3).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from partita.errors import PartitaError

if TYPE_CHECKING:
    from partita.zero.engine import DataParallel

# id(parameter) -> (the engine owning it, the parameter's name in that engine's module).
# Ids are safe keys: a live engine holds its parameters (FlatBuffer.params), and an entry
# whose engine died is ignored and dropped.
_OWNERS: dict[int, tuple[weakref.ref, str]] = {}
# Bumped whenever the table changes, so a torch optimizer is checked again after it.
_generation = 0
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_hook = None


def _owner(p: torch.Tensor) -> tuple[DataParallel, str] | None:
    entry = _OWNERS.get(id(p))
    if entry is None:
        return None
    engine = entry[0]()
    if engine is None:
        del _OWNERS[id(p)]
        return None
    return engine, entry[1]


def claim(engine: DataParallel, named: Iterable[tuple[str, nn.Parameter]]) -> None:
    """Record `engine` as the owner of `named`; a PartitaError if a live engine that
    was not closed owns one already."""
    global _generation, _hook
    named = list(named)
    for name, p in named:
        held = _owner(p)
        if held is not None:
            raise PartitaError(
                f"parameter '{name}' already belongs to another DataParallel engine: "
                "the module, or a module sharing parameters with it, was wrapped twice. Two engines would each rebind the parameters to "
                "buffers of their own and each hook their gradients, so training would "
                "be silently wrong. Keep using the first engine, or call close() on it "
                "before wrapping the module again (after ZeRO-3, whose closed engine leaves "
                "the parameters empty, wrap a newly built module).")
    ref = weakref.ref(engine)
    for name, p in named:
        _OWNERS[id(p)] = (ref, name)
    _generation += 1
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_optimizer)


def release(engine: DataParallel) -> None:
    """`engine` no longer owns anything (DataParallel.close)."""
    global _generation
    for key in [k for k, (ref, _) in _OWNERS.items() if ref() in (engine, None)]:
        del _OWNERS[key]
    _generation += 1


def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global `torch.optim` step pre-hook: refuse to step engine-owned parameters where
    the engine does not expose them as a plain replicated model (see module docstring)."""
    if not _OWNERS or _checked.get(optimizer) == _generation:
        return None
    for group in optimizer.param_groups:
        for p in group["params"]:
            held = _owner(p)
            if held is not None and not held[0].torch_optimizer_allowed:
                engine, name = held
                raise PartitaError(
                    f"{type(optimizer).__name__}.step() was called on parameter '{name}', "
                    f"which a DataParallel engine (ZeRO stage {int(engine.stage)}) owns "
                    "and updates itself: at stages 1-3 each rank's optimizer state covers "
                    "only its own slice and .grad is not the averaged gradient (None at "
                    "stages 2-3, so a torch optimizer silently skips the parameter), and "
                    "the engine's master weights overwrite the parameters at its next "
                    "step. Use the engine's own step instead: dp.finish_grad_sync(), "
                    "dp.clip_grad_norm_(max_norm), dp.step(lr), dp.zero_grad(), with "
                    "DataParallel(..., optim=AdamWConfig(...)). A torch optimizer is "
                    "accepted only at ZeRO stage 0 without offload and with reduce_dtype "
                    "equal to param_dtype, where .grad holds the averaged gradient.")
    _checked[optimizer] = _generation
    return None


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters an engine over `module` owns: trainable ones, each once."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def frozen(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters an engine over `module` leaves alone: frozen ones, each once."""
    return [(n, p) for n, p in module.named_parameters() if not p.requires_grad]


def check_still_frozen(left_out: list[tuple[str, nn.Parameter]]) -> None:
    """Refuse a parameter that was frozen when the engine was built and trains now: the
    engine neither averages its gradient nor updates it, so each replica would keep its
    own gradient and the parameter would never move. One flag read per frozen parameter
    and step (microseconds even for a LoRA fine-tune's hundreds of frozen tensors)."""
    for name, p in left_out:
        if p.requires_grad:
            raise PartitaError(
                f"parameter '{name}' was unfrozen (requires_grad=True) after "
                "DataParallel wrapped the model: the engine leaves parameters that were "
                "frozen at wrapping out of its buffers, so it would neither average its "
                "gradient over the replicas nor update it. Unfreeze parameters before "
                "wrapping the model, or call dp.close() and wrap the model again after "
                "changing which parameters train.")


def state_dict_hooks(module: nn.Module, engine: DataParallel) -> list:
    """`state_dict()` pre-hooks on every module that holds parameters, so that a state
    dict read at any level sees the current values: at stages 1-2 (and under host
    offload) they wait for what step() left running, whose all-gathers otherwise land
    only in the next forward; at stage 3 they refuse a read outside
    gathered_parameters(), where a parameter at rest is an empty tensor."""

    def hook(mod: nn.Module, prefix: str, keep_vars: bool) -> None:
        engine.wait_params()  # nothing to wait for costs two attribute checks
        if engine.gatherer is not None and not all(
                b.full_allocated for b in engine.buckets if id(b) in mine.get(id(mod), ())):
            raise PartitaError(
                f"state_dict() of '{prefix.rstrip('.') or type(mod).__name__}' was read "
                "while ZeRO-3 keeps its parameters sharded (at rest each is an empty "
                "tensor). Read it inside `with dp.gathered_parameters():` and clone the "
                "tensors there (`{k: v.clone() for k, v in model.state_dict().items()}`): "
                "the gathered buffers are freed when the block ends.")

    where = {id(p): b for b in engine.buckets for p in b.params}
    mine: dict[int, set[int]] = {}
    handles = []
    for m in module.modules():
        bufs = {id(where[id(p)]) for p in m.parameters(recurse=False) if id(p) in where}
        if bufs:
            mine[id(m)] = bufs
            handles.append(m.register_state_dict_pre_hook(hook))
    return handles
