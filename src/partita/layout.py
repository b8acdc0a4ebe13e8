"""A parallel layout, and every reason one cannot run on a model and a world.

A `Layout` is the whole answer to "how is this training run split over processes": the
degrees of each parallel dimension and the policies that go with them. The config
(`Config.layout`), the planner and the trainer all use this one type, with one spelling
for every name: the config keys of `[parallel]`.

`find_problems` lists every reason a layout cannot train a model on a world and a batch;
`validate` raises them all at once. The command line calls it before launching, each
worker calls it before any process waits on another, and the planner calls it so that
it never ranks a layout `partita train` refuses.

Pure data: no torch, no process group, so the planner and the launcher can use it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, NamedTuple

from partita.errors import PartitaError, did_you_mean

if TYPE_CHECKING:  # only its fields are read; importing `partita.models` loads torch
    from partita.models.model_config import ModelConfig

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
OVERLAP_OPTIONS = ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather")

# Kinds of problem, so that callers can sort them (the planner counts rejections by kind).
DIVISIBILITY, CONSTRAINT, UNAVAILABLE = "divisibility", "constraint", "not available yet"

ZERO3_PIPELINE_REASON = (
    "ZeRO stage 3 with pipeline parallelism (parallel.pp > 1) is not supported: stage 3 "
    "gathers each block's parameters around its forward and backward and frees them "
    "after, but a pipeline stage runs the forwards and backwards of many microbatches "
    "interleaved, so every block would be gathered again for every microbatch and pass "
    "(about 3 x microbatches all-gathers per step instead of 3), and a zero-bubble W pass "
    "would need them once more. Use parallel.zero_stage=2 with the pipeline (gradients "
    "and optimizer state stay sharded), or drop the pipeline to use stage 3."
)


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



class Problem(NamedTuple):
    """One reason a layout cannot run: its kind and a sentence that says what to change."""

    kind: str
    message: str


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
                f"{_divisors(self.dp * self.cp)}."
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
                              ("cp_kind", CP_KINDS)):
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


def _deprecated(old: str, new: str) -> None:
    # FutureWarning, not DeprecationWarning: it is meant for users and shown by default.
    warnings.warn(f"{old} is deprecated; write {new} instead.", FutureWarning, stacklevel=3)


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
    for item in text.replace(",", " ").split():
        key, sep, raw = item.partition("=")
        key = key.strip().lower()
        if key in RENAMED:
            _deprecated(f"layout name '{key}'", f"'{RENAMED[key]}'")
            key = RENAMED[key]
        if not sep or key not in known:
            raise PartitaError(
                f"cannot read '{item}' in layout '{text}'.{did_you_mean(key, known)} Write "
                f"name=value pairs with names among {', '.join(known)}."
            )
        values[key] = _convert(key, raw.strip(), text)
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
    if key in ("recompute", "offload", "schedule", "cp_kind"):
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


# The rules ---------------------------------------------------------------------------
def find_problems(layout: Layout, model: ModelConfig, world_size: int, *, seq_len: int,
                  global_batch: int) -> list[Problem]:
    """Every reason `layout` cannot train `model` on `world_size` processes with
    `global_batch` sequences of `seq_len` tokens per step; empty when it can."""
    out: list[Problem] = []
    lay = layout
    if lay.world_size != world_size:
        out.append(Problem(DIVISIBILITY, world_size_message(lay.degrees, world_size)))
    out += _experts(lay, model)
    out += _recompute(lay, model)
    out += _tensor_parallel(lay, model, seq_len)
    out += _pipeline(lay, model)
    out += _batch(lay, global_batch)
    if lay.tp_comm_overlap:
        out.append(Problem(UNAVAILABLE, "tensor-parallel communication overlap "
                                        "(tp_comm_overlap) is not available yet in partita "
                                        "train; set tp_comm_overlap=false."))
    out += _context_parallel(lay, model, seq_len)
    return out


def validate(layout: Layout, model: ModelConfig, world_size: int, *, seq_len: int,
             global_batch: int) -> None:
    """Raise PartitaError naming every problem of `find_problems`, if there is any."""
    problems = find_problems(layout, model, world_size, seq_len=seq_len,
                             global_batch=global_batch)
    if len(problems) == 1:
        raise PartitaError(problems[0].message)
    if problems:
        raise PartitaError(f"the layout {layout.describe()} cannot run, for "
                           f"{len(problems)} reasons:\n" +
                           "\n".join(f"  - {p.message}" for p in problems))


def world_size_message(degrees: Degrees, world_size: int) -> str:
    d = degrees
    other = d.tp * d.pp * d.cp
    return (f"the layout dp={d.dp} x tp={d.tp} x pp={d.pp} x cp={d.cp} needs "
            f"{d.world_size} processes but {world_size} were started. Start "
            f"{d.world_size} processes (--nproc {d.world_size}), or change the degrees so "
            f"that their product is {world_size} (for example "
            f"--parallel.dp={max(1, world_size // other)}).")


def _experts(lay: Layout, model: ModelConfig) -> list[Problem]:
    """Expert parallelism needs MoE blocks whose experts split evenly over ep; MoE blocks
    do not run yet with sequence or context parallelism or with recomputation."""
    out, ep, n_experts = [], lay.ep, getattr(model, "n_experts", 0)
    if ep > 1 and not n_experts:
        out.append(Problem(CONSTRAINT, f"parallel.ep={ep} spreads experts over ranks, but "
                                       "the model has no MoE blocks; set parallel.ep=1, or "
                                       "use an MoE model (model.n_experts > 0, e.g. "
                                       "--model.name=tiny-moe)."))
    elif ep > 1 and n_experts % ep:
        ok = [d for d in _divisors(n_experts) if (lay.dp * lay.cp) % d == 0]
        out.append(Problem(DIVISIBILITY, f"model.n_experts={n_experts} is not divisible by "
                                         f"parallel.ep={ep}: every expert-parallel rank holds "
                                         f"as many experts. Use ep among {ok}, or a number "
                                         f"of experts divisible by {ep}."))
    if not n_experts:
        return out
    for bad, what, fix in ((lay.sequence_parallel, "sequence parallelism",
                            "parallel.sequence_parallel=false"),
                           (lay.cp > 1 and ep == 1, "context parallelism", "parallel.cp=1"),
                           (lay.recompute != "none", "activation recomputation",
                            "parallel.recompute=none")):
        if bad:
            out.append(Problem(UNAVAILABLE, f"mixture-of-experts blocks with {what} are not "
                                            f"available yet; set {fix}."))
    return out


def _recompute(lay: Layout, model: ModelConfig) -> list[Problem]:
    out = []
    if lay.recompute != "none" and model.n_layers < 1:
        out.append(Problem(CONSTRAINT, f"recompute={lay.recompute} reruns blocks in backward, "
                                       "but the model has no blocks; use recompute=none."))
    if lay.recompute_layers and lay.recompute == "none":
        out.append(Problem(CONSTRAINT, f"parallel.recompute_layers={lay.recompute_layers} "
                                       "with recompute=none recomputes nothing; set "
                                       "parallel.recompute to full or selective, or "
                                       "recompute_layers=0."))
    if "+params" in lay.offload and lay.zero_stage != 3:
        out.append(Problem(CONSTRAINT, f"offload={lay.offload} keeps ZeRO-3's parameter "
                                       f"shards off the device, but zero_stage="
                                       f"{lay.zero_stage} has none; use zero_stage=3, or "
                                       "offload=optimizer."))
    per_stage = -(-model.n_layers // lay.pp)
    if lay.recompute_layers > per_stage:
        out.append(Problem(CONSTRAINT, f"parallel.recompute_layers={lay.recompute_layers} is "
                                       f"more than the {per_stage} blocks a pipeline stage "
                                       f"holds at most ({model.n_layers} blocks over pp="
                                       f"{lay.pp}); use at most {per_stage}, or 0 for every "
                                       "block."))
    return out


def _context_parallel(lay: Layout, model: ModelConfig, seq_len: int) -> list[Problem]:
    """What context parallelism (cp > 1) needs, and the combinations it does not run yet."""
    cp, out = lay.cp, []
    if cp == 1:
        return out
    if seq_len < 2 * cp:
        out.append(Problem(DIVISIBILITY, f"parallel.cp={cp} needs 2*cp={2 * cp} chunks of every "
                                         f"sequence, but data.seq_len={seq_len} has fewer "
                                         f"tokens; use cp <= {max(1, seq_len // 2)} or "
                                         "longer sequences."))
    elif seq_len % (2 * cp):
        out.append(Problem(DIVISIBILITY, f"data.seq_len={seq_len} is not divisible by "
                                         f"2*cp={2 * cp}: context parallelism cuts every "
                                         f"sequence into 2*cp equal chunks (rank r holds "
                                         f"chunks r and 2cp-1-r). Use a multiple of {2 * cp}."))
    elif lay.sequence_parallel and (seq_len // cp) % lay.tp:
        out.append(Problem(DIVISIBILITY, f"each context-parallel rank holds {seq_len // cp} "
                                         f"tokens, not divisible by tp={lay.tp} for sequence "
                                         f"parallelism; use a seq_len that is a multiple of "
                                         f"{2 * cp * lay.tp}."))
    if model.flavour == "gpt2":
        out.append(Problem(CONSTRAINT, "context parallelism with learned position embeddings "
                                       "(model flavour gpt2) is not available yet: only "
                                       "rotary positions follow the sharded tokens. Use a "
                                       "llama-flavoured model, or parallel.cp=1."))
    for what, bad, fix in (("expert parallelism", lay.ep > 1, "parallel.ep=1"),
                           ("activation recomputation", lay.recompute != "none",
                            "recompute=none")):
        if bad:
            out.append(Problem(UNAVAILABLE, f"context parallelism (parallel.cp={cp}) with "
                                            f"{what} is not available yet; set {fix}, or "
                                            "parallel.cp=1."))
    return out


def _tensor_parallel(lay: Layout, model: ModelConfig, seq_len: int) -> list[Problem]:
    out, tp = [], lay.tp
    if lay.sequence_parallel and tp == 1:
        out.append(Problem(CONSTRAINT, "sequence parallelism shards activations over the "
                                       "tensor-parallel group, but parallel.tp=1. Set "
                                       "parallel.tp to 2 or more, or turn sequence "
                                       "parallelism off."))
    if lay.sequence_parallel and tp > 1 and seq_len % tp:
        out.append(Problem(DIVISIBILITY, f"data.seq_len={seq_len} is not divisible by tp={tp}; "
                                         "sequence parallelism cuts the sequence into tp equal "
                                         "pieces. Use a sequence length that is a multiple of "
                                         f"{tp}, or a tp degree among {_divisors(seq_len)}."))
    if tp == 1:
        return out
    if model.n_heads % tp:
        out.append(Problem(DIVISIBILITY, f"model.n_heads={model.n_heads} is not divisible by "
                                         f"tp={tp}: attention is split by heads, so every rank "
                                         "needs the same number of whole heads. Valid tp "
                                         f"degrees: {_divisors(model.n_heads)}."))
    for n, what in ((model.ffn_hidden, "model ffn hidden width"),
                    (model.vocab_size, "model.vocab_size")):
        if not _padded_split_ok(n, tp):
            ok = [t for t in range(1, min(n, 4096) + 1) if _padded_split_ok(n, t)]
            shown = str(ok) if len(ok) <= 12 else f"{ok[:12]} ..."
            out.append(Problem(DIVISIBILITY, f"{what}={n} cannot be split over tp={tp} ranks: "
                                             f"with padding to a multiple of {tp} the last rank "
                                             f"would own no real row. Use a tp degree among "
                                             f"{shown}."))
    return out


def _padded_split_ok(n: int, parts: int) -> bool:
    """Padded to a multiple of `parts`, the last rank still owns a real row."""
    return parts == 1 or (parts - 1) * math.ceil(n / parts) < n


def _pipeline(lay: Layout, model: ModelConfig) -> list[Problem]:
    out, v = [], lay.virtual_stages
    if v > 1 and lay.schedule != "interleaved-1f1b":
        out.append(Problem(CONSTRAINT, f"the {lay.schedule} schedule runs one stage per rank, "
                                       f"but parallel.virtual_stages={v}; use "
                                       "parallel.schedule=interleaved-1f1b for several "
                                       "virtual stages per rank, or set virtual_stages=1."))
    if lay.pp == 1:
        if v > 1:
            out.append(Problem(CONSTRAINT, f"parallel.virtual_stages={v} needs a pipeline "
                                           "(parallel.pp > 1); set virtual_stages=1."))
        return out
    if model.n_layers < lay.pp * v:
        out.append(Problem(DIVISIBILITY, f"the model has {model.n_layers} blocks but "
                                         f"parallel.pp={lay.pp} x parallel.virtual_stages={v} "
                                         f"= {lay.pp * v} pipeline stages; every stage needs "
                                         f"at least one block. Use at most {model.n_layers} "
                                         "stages in all (fewer virtual stages or a smaller "
                                         "pp), or a deeper model (model.n_layers)."))
    if lay.zero_stage == 3:
        out.append(Problem(CONSTRAINT, ZERO3_PIPELINE_REASON))
    return out


def _batch(lay: Layout, global_batch: int) -> list[Problem]:
    if global_batch < 1 or global_batch % lay.dp:
        return [Problem(DIVISIBILITY, f"train.global_batch={global_batch} is not divisible by "
                                      f"the {lay.dp} data-parallel replicas; choose a multiple "
                                      f"of {lay.dp}.")]
    local = global_batch // lay.dp
    if local % lay.microbatch_size:
        return [Problem(DIVISIBILITY, f"each replica's batch of {local} sequences cannot be "
                                      f"cut into microbatches of {lay.microbatch_size} "
                                      "sequences; choose a number of microbatches "
                                      f"(train.microbatches) that divides {local}.")]
    m = local // lay.microbatch_size
    if lay.pp > 1 and lay.schedule == "interleaved-1f1b" and m % lay.pp:
        lower, upper = (m // lay.pp) * lay.pp, (m // lay.pp + 1) * lay.pp
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        return [Problem(CONSTRAINT, f"interleaved-1f1b sends microbatches round the {lay.pp} "
                                    f"pipeline stages in groups of {lay.pp}, so the number "
                                    f"of microbatches must be a multiple of {lay.pp}; got "
                                    f"{m}. Use {hint} microbatches (train.microbatches), or "
                                    "the 1f1b schedule.")]
    return []


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
