"""A parallel layout: degrees, policies, and their text form.

A `Layout` is the whole answer to "how is this training run split over processes": the
degrees of each parallel dimension and the policies that go with them. The config
(`Config.layout`), the planner and the trainer all use this one type, with one spelling
for every name: the config keys of `[parallel]`. Whether a layout can run on a model and
a world is `partita.layout_rules`.

Pure data: no torch, no process group, so the planner and the launcher can use it.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass, fields, replace

from partita.errors import PartitaError, did_you_mean, pair_hint

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
# Other names a schedule has been written as; accepted with a deprecation warning.
SCHEDULE_ALIASES = {"interleaved": "interleaved-1f1b", "zero-bubble": "zb-h1",
                    "zbh1": "zb-h1"}
# Other names of a ZeRO stage: Megatron's distributed optimizer shards optimizer states
# (and master weights) over the data-parallel group, which is ZeRO-1.
ZERO_STAGE_ALIASES = {"distributed-optimizer": 1, "distributed_optimizer": 1}
RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "optimizer", "optimizer+params", "optimizer+disk",
           "optimizer+params+disk")
DEGREES = ("dp", "tp", "pp", "cp", "ep")
CP_KINDS = ("ring", "allgather")
# How MoE feed-forwards use the tensor-parallel group (partita.tensor_parallel.moe).
MOE_TP = ("replicate", "experts", "hidden")
OVERLAP_OPTIONS = ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather")


@dataclass(frozen=True)
class ZeroStage:
    """What ZeRO stage `number` shards over the data-parallel group, and what follows
    from it. Each stage shards what the one before does, and one thing more:

      0  nothing (plain data parallelism: gradients all-reduced, full optimizer states);
      1  optimizer states (and master weights): each rank updates its own slice;
      2  + gradients: each rank keeps only its slice of the reduced gradient;
      3  + parameters: gathered around compute, a slice at rest.

    The number stays the user-facing value (`parallel.zero_stage`); code reads the
    properties, never the number."""

    number: int

    def __post_init__(self) -> None:
        if isinstance(self.number, bool) or self.number not in (0, 1, 2, 3):
            raise PartitaError(
                f"parallel.zero_stage={self.number} is invalid: use 0 (plain data parallel), "
                "1 (shard optimizer state), 2 (+ gradients) or 3 (+ parameters)."
            )

    @classmethod
    def of(cls, stage: int | ZeroStage) -> ZeroStage:
        return stage if isinstance(stage, ZeroStage) else cls(stage)

    def __int__(self) -> int:
        return self.number

    def __str__(self) -> str:
        return f"ZeRO-{self.number}"

    @property
    def shards_optimizer_states(self) -> bool:
        """Each rank updates only its own slice of every bucket (its moments and master
        weights), so the gradient norm is summed over the group."""
        return self.number >= 1

    @property
    def shards_gradients(self) -> bool:
        """Reduced gradients are kept as the owned slice only; without this the full
        gradient buffers live for the whole run and .grad are views into them."""
        return self.number >= 2

    @property
    def shards_parameters(self) -> bool:
        """Parameters are a slice at rest, gathered block by block around compute."""
        return self.number >= 3

    @property
    def all_reduces_gradients(self) -> bool:
        """Gradients are all-reduced (every rank holds all of them); otherwise they are
        reduce-scattered (each rank receives the sum of its own slice)."""
        return not self.shards_optimizer_states

    @property
    def gathers_parameters_after_step(self) -> bool:
        """Every rank keeps full parameters but updates only its slice: the updated
        slices are all-gathered after each step (stage 3 gathers before compute)."""
        return self.shards_optimizer_states and not self.shards_parameters

    @property
    def can_buffer_accumulation(self) -> bool:
        """Gradient accumulation may choose between reducing every microbatch and one
        full-size buffer reduced at the boundary (see ACCUMULATION_MODES)."""
        return self.shards_gradients and not self.shards_parameters


@dataclass(frozen=True)
class Degrees:
    """The degrees alone: what the rank grid (`partita.mesh`) is built from."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in DEGREES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PartitaError(
                    f"parallel.{name}={value!r} is invalid: every degree is a positive "
                    "integer (1 turns that dimension off)."
                )
        if (self.dp * self.cp) % self.ep:
            raise PartitaError(
                f"parallel.ep={self.ep} must divide dp*cp={self.dp * self.cp}: expert "
                "parallel ranks are carved out of the data x context ranks. Valid ep: "
                f"{divisors(self.dp * self.cp)}."
            )

    @property
    def world_size(self) -> int:
        """Processes the layout needs (ep is carved out of dp x cp, so it does not count)."""
        return self.dp * self.tp * self.pp * self.cp

    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def __str__(self) -> str:
        extra = "".join(f" {k}={getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) > 1)
        return f"dp={self.dp} tp={self.tp} pp={self.pp}{extra}"


@dataclass(frozen=True)
class Layout:
    """Degrees and policies of one parallel training run.

    `microbatch_size` is in sequences: each data-parallel replica cuts its share of the
    global batch (global_batch / dp sequences; context-parallel ranks split every
    sequence's tokens instead) into microbatches of this many sequences. The number of
    microbatches per step, which the pipeline schedule runs, is `microbatches(batch)`.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0  # 0 plain data parallel; 1 shard optimizer state; 2 + grads; 3 + params
    schedule: str = "1f1b"  # pipeline schedule, one of SCHEDULES
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved-1f1b: >= 2)
    microbatch_size: int = 1
    sequence_parallel: bool = False  # shard norms and dropout over tp (needs tp > 1)
    recompute: str = "none"  # activation recomputation, one of RECOMPUTE
    # Recompute only the first K blocks of each pipeline stage (0: every block).
    recompute_layers: int = 0
    offload: str = "none"  # what lives in host memory, one of OFFLOAD
    # Communication overlap (Megatron's --tp-comm-overlap, --overlap-grad-reduce,
    # --overlap-param-gather). partita reduces gradient buckets during backward and
    # gathers ZeRO parameters ahead of use; it does not chunk TP collectives yet.
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    cp_kind: str = "ring"  # context-parallel attention: ring or allgather (CP_KINDS)
    # How MoE feed-forwards use the tp group: "replicate" (every tp rank holds every
    # expert), "experts" (the tp ranks split the experts) or "hidden" (they split each
    # expert's width); partita.tensor_parallel.moe.
    moe_tp: str = "replicate"

    def __post_init__(self) -> None:
        Degrees(**{k: getattr(self, k) for k in DEGREES})  # checks the degrees
        ZeroStage(self.zero_stage)  # checks the stage
        object.__setattr__(self, "schedule", canonical_schedule(self.schedule))
        for name in ("virtual_stages", "microbatch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PartitaError(f"layout {name}={value!r} is invalid: use an integer >= 1.")
        k = self.recompute_layers
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise PartitaError(f"parallel.recompute_layers={k!r} is invalid: use 0 (every "
                               "block) or the number of blocks per stage to recompute.")
        for name, options in (("recompute", RECOMPUTE), ("offload", OFFLOAD),
                              ("cp_kind", CP_KINDS), ("moe_tp", MOE_TP)):
            if getattr(self, name) not in options:
                raise PartitaError(
                    f"layout {name}={getattr(self, name)!r} is unknown; choose one of "
                    f"{', '.join(options)}."
                )
        for name in OVERLAP_OPTIONS:
            value = getattr(self, name)
            if value not in (0, 1):  # True, False, 1, 0 (the text form gives integers)
                raise PartitaError(f"layout {name}={value!r} is invalid: use true or false.")
            object.__setattr__(self, name, bool(value))

    @property
    def degrees(self) -> Degrees:
        return Degrees(**{k: getattr(self, k) for k in DEGREES})

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        """The tp ranks that share each MoE block's expert work (1: replicated)."""
        return self.tp if self.moe_tp != "replicate" else 1

    @property
    def experts_over_tp(self) -> int:
        """The tp ranks that split the experts themselves (moe_tp="experts"), so that
        each runs 1/tp of the routed rows; 1 otherwise."""
        return self.tp if self.moe_tp == "experts" else 1

    @property
    def zero_group(self) -> int:
        """Ranks ZeRO shards dense model states over (and dense gradients are reduced over)."""
        return self.dp * self.cp

    def microbatches(self, global_batch: int) -> int:
        """Microbatches per optimizer step on each replica (0 when the batch does not divide)."""
        per_step = self.dp * self.microbatch_size
        return global_batch // per_step if global_batch % per_step == 0 else 0

    def describe(self) -> str:
        """The short text form `parse_layout` reads back: non-default policies only."""
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        parts += [f"{k}={getattr(self, k)}" for k in ("cp", "ep", "virtual_stages")
                  if getattr(self, k) > 1]
        parts += [f"zero_stage={self.zero_stage}", f"microbatch_size={self.microbatch_size}"]
        if self.pp > 1 and self.schedule != default_schedule(self.virtual_stages):
            parts.append(f"schedule={self.schedule}")
        if self.sequence_parallel:
            parts.append("sequence_parallel=1")
        for name in ("recompute", "offload"):
            if getattr(self, name) != "none":
                parts.append(f"{name}={getattr(self, name)}")
        if self.recompute_layers:
            parts.append(f"recompute_layers={self.recompute_layers}")
        if self.cp > 1 and self.cp_kind != "ring":
            parts.append(f"cp_kind={self.cp_kind}")
        if self.moe_tp != "replicate":
            parts.append(f"moe_tp={self.moe_tp}")
        defaults = {f.name: f.default for f in fields(self)}  # what partita itself does
        parts += [f"{name}={int(getattr(self, name))}" for name in OVERLAP_OPTIONS
                  if getattr(self, name) != defaults[name]]
        return " ".join(parts)

    def __str__(self) -> str:
        return self.describe()

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def with_(self, **changes) -> Layout:
        return replace(self, **changes)


def default_schedule(virtual_stages: int) -> str:
    return "interleaved-1f1b" if virtual_stages > 1 else "1f1b"


def canonical_schedule(name: str) -> str:
    """The one spelling of a schedule name; old spellings warn, unknown ones raise."""
    key = str(name).strip().lower()
    if key in SCHEDULE_ALIASES:
        _deprecated(f"schedule '{key}'", f"'{SCHEDULE_ALIASES[key]}'")
        return SCHEDULE_ALIASES[key]
    if key not in SCHEDULES:
        raise PartitaError(
            f"unknown pipeline schedule '{name}'.{did_you_mean(key, SCHEDULES)} Known "
            f"schedules: {', '.join(SCHEDULES)}."
        )
    return key


class OldSpelling(FutureWarning):
    """An old spelling was read (a schedule or layout name): a FutureWarning, not a
    DeprecationWarning, as it is meant for users and shown by default."""


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated; write {new} instead.", OldSpelling, stacklevel=3)


_NOTED: set[str] = set()  # the notes this process printed


def notes_for_old_spellings() -> None:
    """From now on, show each `OldSpelling` warning as one `partita: note:` line on
    stderr, once per process (on rank 0 only, under torchrun), instead of Python's two
    lines naming partita's source. The command line calls this: the checks that resolve
    a name run more than once a job, and a warning names the line that read it."""
    shown = warnings.showwarning
    if getattr(shown, "old_spellings_as_notes", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, OldSpelling):
            return shown(message, category, filename, lineno, file, line)
        text = f"partita: note: {message}"
        if text not in _NOTED and os.environ.get("RANK", "0") == "0":
            _NOTED.add(text)
            print(text, file=sys.stderr, flush=True)
        return None

    show.old_spellings_as_notes = True
    warnings.showwarning = show


# Text form ---------------------------------------------------------------------------
# Names the planner's `--layout` text used to take: accepted, with a deprecation warning.
RENAMED = {"zero": "zero_stage", "vpp": "virtual_stages", "v": "virtual_stages",
           "mb": "microbatch_size", "micro_batch": "microbatch_size",
           "microbatch": "microbatch_size", "sp": "sequence_parallel"}


def parse_layout(text: str, world_size: int | None = None) -> Layout:
    """`"dp=8 tp=2 pp=2 zero_stage=1"` (spaces or commas) -> Layout.

    Omitted degrees are 1, except dp, which is filled in from `world_size` when given.
    Sequence parallelism defaults to on when tp > 1 (the usual choice with tensor
    parallelism), and the schedule to interleaved-1f1b when virtual_stages > 1.
    """
    known = [f.name for f in fields(Layout)]
    values: dict[str, object] = {}
    given: dict[str, str] = {}  # name -> the item that set it
    for item in text.replace(",", " ").split():
        key, sep, raw = item.partition("=")
        key = key.strip().lower()
        if key in RENAMED:
            _deprecated(f"layout name '{key}'", f"'{RENAMED[key]}'")
            key = RENAMED[key]
        if not sep or key not in known:
            raise PartitaError(
                f"cannot read '{item}' in layout '{text}'.{pair_hint(key, known)} Write "
                f"name=value pairs with names among {', '.join(known)}."
            )
        if key in given:  # a later value would silently win over the first
            raise PartitaError(
                f"layout '{text}' gives {key} twice ('{given[key]}' and '{item}'); "
                "give each name once."
            )
        given[key] = item
        values[key] = _convert(key, raw.strip(), text)
    for name in DEGREES:  # before dp is derived from them, so none divides by zero
        value = values.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PartitaError(
                f"layout '{text}': {name}={value} is invalid: every degree is a positive "
                "integer (1 turns that dimension off)."
            )
    if "dp" not in values and world_size is not None:
        other = math.prod(int(values.get(k, 1)) for k in ("tp", "pp", "cp"))
        if world_size % other:
            raise PartitaError(
                f"layout '{text}': tp*pp*cp={other} does not divide the {world_size} "
                "processes (GPUs)."
            )
        values["dp"] = world_size // other
    values.setdefault("sequence_parallel", int(values.get("tp", 1)) > 1)
    values.setdefault("schedule", default_schedule(int(values.get("virtual_stages", 1))))
    return Layout(**values)


def _convert(key: str, raw: str, text: str) -> object:
    if key in ("recompute", "offload", "schedule", "cp_kind", "moe_tp"):
        return raw.lower()
    if key == "zero_stage" and raw.lower() in ZERO_STAGE_ALIASES:
        return ZERO_STAGE_ALIASES[raw.lower()]
    if key in ("sequence_parallel", *OVERLAP_OPTIONS):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise PartitaError(f"layout '{text}': {key}={raw} is not true or false (1 or 0).")
    try:
        return int(raw)
    except ValueError:
        raise PartitaError(f"layout '{text}': {key}={raw} is not an integer.") from None


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending (the degrees a message can suggest); pairs up to
    sqrt(n), so a model dimension in the billions costs milliseconds, not minutes."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n > 0 else []
    return sorted(set(small + [n // d for d in small]))
