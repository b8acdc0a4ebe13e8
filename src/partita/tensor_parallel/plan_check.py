"""Checks of a model and its plan before tensor parallelism changes anything.

Mistakes in a plan otherwise surface deep inside torch as shape errors, or not at all:

- a colwise layer splits its output features over the tp ranks and only a rowwise
  layer beside it (a child of the same module, as apply.py enters the region once per
  such module) adds the pieces up again, so each needs the other; an nn.Linear with no
  role beside them computes on whole features while its siblings compute on shards;
- a parameter shared by two modules (`out.weight = tok.weight`) becomes two tensors
  when tensor parallelism replaces one of the modules by its shard, and the two then
  train apart. Tied embeddings are declared in the plan instead (`ModelPlan.tied_head`).

Both raise PartitaError on every rank alike, since every rank holds the same model.
"""

from __future__ import annotations

import difflib
import fnmatch
import re

import torch.nn as nn

from partita.errors import PartitaError
from partita.models import plan as roles

# Roles whose modules tensor parallelism replaces by a shard holding new parameters.
_SPLIT_ROLES = (roles.COLWISE, roles.ROWWISE, roles.VOCAB_EMBEDDING, roles.VOCAB_HEAD)
_SHOWN = 3  # problems named in a message; the rest are counted
_INDEX = re.compile(r"(?<![^.\s])\d+(?![^.\s])")  # a block index: the same problem in each


def check_plan(model: nn.Module, plan: roles.ModelPlan, moe_tp: str = "replicate") -> None:
    """Raise PartitaError for a plan tensor parallelism cannot apply to `model`: a
    colwise layer without its rowwise partner (or the reverse), an unplanned nn.Linear
    beside split layers, or a parameter shared by a module it splits and another."""
    check_pairs(model, plan)
    check_shared(model, plan, moe_tp)


def check_pairs(model: nn.Module, plan: roles.ModelPlan) -> None:
    """Every module holding colwise or rowwise layers holds both, and no other Linear."""
    groups: dict[str, dict[str, list[str]]] = {}
    for name, _ in model.named_modules():
        role = plan.role_of(name) if name else None
        if role in (roles.COLWISE, roles.ROWWISE):
            parent = name.rpartition(".")[0]
            groups.setdefault(parent, {roles.COLWISE: [], roles.ROWWISE: []})[role].append(name)
    problems: dict[str, list[str]] = {}
    for parent, by_role in groups.items():
        cols, rows = by_role[roles.COLWISE], by_role[roles.ROWWISE]
        prefix = f"{parent}." if parent else ""
        loose = [prefix + n for n, child in model.get_submodule(parent).named_children()
                 if isinstance(child, nn.Linear) and plan.role_of(prefix + n) is None]
        where = parent or "the model's root module"
        hint = f" (its nn.Linear without a role: {', '.join(loose)})" if loose else ""
        if not rows:
            text = f"{', '.join(cols)} colwise but {where} has no rowwise layer{hint}"
        elif not cols:
            text = f"{', '.join(rows)} rowwise but {where} has no colwise layer{hint}"
        elif loose:
            text = f"{', '.join(loose)} in {where} beside its split layers has no role"
        else:
            continue
        problems.setdefault(_INDEX.sub("*", parent), []).append(text)
    if problems:
        raise PartitaError(
            "the model's plan splits layers over tensor parallelism without their "
            f"partners: {_listed(problems)}. A colwise layer splits its output features "
            "over the tp ranks and only a rowwise layer in the same module adds the "
            "pieces up again, so each needs the other, and every nn.Linear of such a "
            "module needs one of the two roles. Add the missing roles to ModelPlan.roles "
            "(attention: query, key and value projections colwise, output projection "
            "rowwise; MLP: up and gate colwise, down rowwise), or remove the module's "
            "roles to keep it whole on every rank."
        )


def check_shared(model: nn.Module, plan: roles.ModelPlan, moe_tp: str = "replicate") -> None:
    """No parameter is shared between a module tensor parallelism splits and another."""
    split_roles = _SPLIT_ROLES + ((roles.MOE,) if moe_tp != "replicate" else ())
    problems: dict[str, list[str]] = {}
    for names in roles.shared_parameters(model):
        owners = [_split_owner(plan, name, split_roles) for name in names]
        split = [f"{module} ({role})" for module, role in filter(None, owners)]
        if split:
            text = (f"{' and '.join(names)} are one tensor, and tensor parallelism "
                    f"replaces {' and '.join(split)} by a shard")
            problems.setdefault(_INDEX.sub("*", " ".join(names)), []).append(text)
    if problems:
        raise PartitaError(
            f"a parameter is shared by modules that tensor parallelism splits on their "
            f"own: {_listed(problems)}. Each shard would hold a copy of its own, and the "
            "copies would train apart. For tied input and output embeddings declare the "
            "tie in the plan: leave the head module None on the model, compute the logits "
            "from the embedding's weight while it is None, name it in ModelPlan.tied_head "
            "(without a vocab_head role) and set tie_embeddings=True in ModelPlan.shape, "
            "as partita's Transformer does; otherwise give each module a parameter of its "
            "own."
        )


def _split_owner(plan: roles.ModelPlan, param_name: str,
                 split_roles: tuple[str, ...]) -> tuple[str, str] | None:
    """(module, role) of the nearest module above the parameter that is split, if any."""
    parts = param_name.split(".")[:-1]
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        role = plan.role_of(module)
        if role in split_roles:
            return module, role
    return None


def _listed(problems: dict[str, list[str]]) -> str:
    """The first instance of each kind of problem (the same in every block is one kind),
    with how many more of that kind there are."""
    shown = []
    for texts in list(problems.values())[:_SHOWN]:
        more = len(texts) - 1
        shown.append(texts[0] + (f" (and {more} more module{'s' * (more > 1)} like it)"
                                 if more else ""))
    rest = len(problems) - _SHOWN
    return "; ".join(shown) + (f"; and {rest} more problems" if rest > 0 else "")


def check_patterns_match(model: nn.Module, plan: roles.ModelPlan) -> None:
    """Every pattern of the plan names at least one module of the whole (uncut) model.

    A misspelt pattern otherwise leaves its modules whole on every rank, silently: a
    plan whose every block role misses trains replicated blocks at any tp. Patterns of
    a dense MLP under a module the plan makes a mixture of experts, and the tied head
    (None on the model), name nothing by design.
    """
    names = [n for n, _ in model.named_modules() if n]
    moe = [n for n in names if plan.role_of(n) == roles.MOE]
    missing = []
    for pattern in plan.roles:
        if pattern == plan.tied_head or any(fnmatch.fnmatchcase(n, pattern) for n in names):
            continue
        parent = pattern.rpartition(".")[0]
        if parent and any(fnmatch.fnmatchcase(n, parent) for n in moe):
            continue
        missing.append(pattern)
    if not missing:
        return
    # Block indices as '*', so the suggestions read like the plan's own patterns.
    shapes = list(dict.fromkeys(_INDEX.sub("*", n) for n in names))
    texts = []
    for pattern in missing[:_SHOWN]:
        near = difflib.get_close_matches(pattern, shapes, n=3, cutoff=0.5)
        texts.append(f"'{pattern}'" + (f" (closest modules: {', '.join(near)})" if near else ""))
    rest = len(missing) - _SHOWN
    raise PartitaError(
        f"the model's plan has {len(missing)} pattern(s) that match no module of "
        f"{type(model).__name__}: {'; '.join(texts)}"
        + (f"; and {rest} more" if rest > 0 else "")
        + ". Their modules would stay whole on every rank. Correct each pattern in "
        "ModelPlan.roles to the module names model.named_modules() gives (fnmatch, '*' "
        "for a block index), or remove it.")
