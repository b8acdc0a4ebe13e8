"""One layout, judged: does it divide, is it allowed, does it fit, and how fast is it.

Rejections carry a kind (`divisibility`, `constraint`, `not available yet`, `memory`) and
a sentence, so the report can say why a layout was ruled out and the advice can say what
would fix it. Whether partita can train a layout at all is `partita.layout`'s rule set,
the same the trainer checks; only memory and the cluster's shape are the planner's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from partita.layout import OVERLAP_OPTIONS, Layout
from partita.layout_rules import CONSTRAINT, DIVISIBILITY, UNAVAILABLE, find_problems
from partita.planner.assumptions import Assumptions
from partita.planner.compiled import compile_in_effect, compiled_activations, overlaps_in_effect
from partita.planner.hardware import Cluster
from partita.planner.memo import memoised
from partita.planner.memory import disk_state_bytes, host_state_bytes, peak_memory
from partita.planner.model_shape import PlanModel
from partita.planner.precision import Precision
from partita.planner.stage_params import stage_layers
from partita.planner.timing import num_microbatches, step_time
from partita.planner.zero_buffers import zero3_buffers

MEMORY = "memory"
__all__ = ["CONSTRAINT", "DIVISIBILITY", "MEMORY", "UNAVAILABLE", "Evaluation", "Request",
           "add_step_time", "evaluate", "layout_text", "memory_reasons", "structural_reasons"]


@dataclass(frozen=True)
class Request:
    """What to plan for: a model on a cluster at a sequence length and global batch."""

    model: PlanModel
    cluster: Cluster
    seq_len: int
    global_batch: int  # sequences per optimizer step
    precision: Precision = Precision()
    assumptions: Assumptions = Assumptions()
    compile: str = "none"  # train.compile asked for (`compile_in_effect` per layout)
    # ZeRO-3's parallel.keep_gathered: a number, "auto" (the most units that fit, at
    # least 1) or None (the assumptions' zero3_kept_units).
    keep_gathered: int | str | None = None


@dataclass
class Evaluation:
    layout: Layout
    reasons: list[tuple[str, str]] = field(default_factory=list)
    memory: dict[str, float] = field(default_factory=dict)  # peak stage, named bytes
    peak_stage: int = 0
    host_bytes_per_node: float = 0.0
    disk_bytes_per_node: float = 0.0  # disk offload's files
    time: dict[str, float] = field(default_factory=dict)
    capacity: float = 0.0
    compile: str = "none"  # the compile mode the time assumes
    kept_units: int | None = None  # ZeRO-3 units kept into backward, where asked for

    @property
    def fits(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict:
        return {
            "layout": layout_text(self.layout),
            "degrees": self.layout.to_dict(),
            "fits": self.fits,
            # Whether memory alone would allow it (false also where it was not judged).
            "fits_in_memory": bool(self.memory) and not any(k == MEMORY
                                                            for k, _ in self.reasons),
            "rejected_because": [{"kind": k, "reason": r} for k, r in self.reasons],
            "memory_bytes": self.memory,
            "peak_stage": self.peak_stage,
            "capacity_bytes": self.capacity,
            "host_bytes_per_node": self.host_bytes_per_node,
            "disk_bytes_per_node": self.disk_bytes_per_node,
            "time": self.time,
            "compile": self.compile,
            # The overlaps the time assumed: the layout's, less what the compile mode
            # in effect cannot overlap.
            "overlap_assumed": {option: getattr(overlaps_in_effect(self.layout, self.compile),
                                                option) for option in OVERLAP_OPTIONS},
            "keep_gathered": self.kept_units,
        }


def layout_text(layout: Layout) -> str:
    """The layout as a plan prints it, which `--layout` reads back as the same layout:
    `Layout.describe`, and sequence parallelism off where tp > 1 (where --layout would
    otherwise turn it on)."""
    text = layout.describe()
    return text + " sequence_parallel=0" if layout.tp > 1 and not layout.sequence_parallel \
        else text


def structural_reasons(req: Request, layout: Layout) -> list[tuple[str, str]]:
    """Everything but memory: whether partita can train the layout at all (the rules of
    `partita.layout_rules.find_problems`, the trainer's own), then what the planner's model of
    a cluster adds (tensor parallelism within a node, MoE experts)."""
    c = req.model.config
    tp_limit = min(req.cluster.gpus_per_node, req.cluster.num_gpus)
    out: list[tuple[str, str]] = [
        (kind, _tp_choices_within(plan_words(text), tp_limit))
        for kind, text in find_problems(layout, c, req.cluster.num_gpus, seq_len=req.seq_len,
                                        global_batch=req.global_batch, planner=True)]
    if layout.tp > 1 and c.kv_heads % layout.tp and layout.tp % c.kv_heads:
        out.append((DIVISIBILITY, f"tp={layout.tp} and {c.kv_heads} kv heads: neither "
                                  "divides the other"))
    out += _options_without_effect(req, layout)
    per_node = req.cluster.gpus_per_node
    if layout.tp > per_node:
        out.append((CONSTRAINT, f"tp={layout.tp} spans nodes of {per_node} "
                                "GPUs; tensor parallelism is placed within a node"))
    elif not req.cluster.within_node(layout.tp):
        # Consecutive ranks form a tp group: one that does not divide the node size
        # leaves some group across two nodes (ranks tp..2tp-1 on 6 per node, tp 4).
        fits = ", ".join(str(d) for d in range(1, per_node + 1) if per_node % d == 0)
        out.append((CONSTRAINT, f"tp={layout.tp} does not divide the {per_node} GPUs of a "
                                f"node, so some tp groups would straddle two nodes (ranks "
                                f"{layout.tp * (per_node // layout.tp)}-"
                                f"{layout.tp * (per_node // layout.tp + 1) - 1}); tensor "
                                f"parallelism is placed within a node: use tp among {fits}"))
    if layout.pp > 1 and layout.virtual_stages > 1 and layout.pp * layout.virtual_stages <= \
            c.n_layers and min(stage_layers(c.n_layers, layout.pp)) < layout.virtual_stages:
        out.append((DIVISIBILITY, f"virtual_stages={layout.virtual_stages} exceeds the "
                                  "layers of a stage"))
    # Expert parallelism is judged by find_problems alone: the plan model's config
    # carries its experts (PlanModel), and a second sentence would count one rule twice.
    # A broken rule first: it is what a layout is rejected as (the first reason), before
    # an option that is merely not available yet.
    return sorted(out, key=lambda reason: reason[0] == UNAVAILABLE)


def _options_without_effect(req: Request, layout: Layout) -> list[tuple[str, str]]:
    """Options set away from their defaults on a layout where they do nothing: a
    prediction that seems to honour them would be the plain layout's."""
    out = []
    if layout.tp_comm_overlap and layout.tp == 1:
        out.append((CONSTRAINT, "tp_comm_overlap=1 overlaps tensor-parallel communication, "
                                "and tp=1 has none; set tp > 1 or drop tp_comm_overlap"))
    if layout.cp_kind != "ring" and layout.cp == 1:
        out.append((CONSTRAINT, f"cp_kind={layout.cp_kind} chooses how context-parallel "
                                "attention communicates, and cp=1 has none; set cp > 1 or "
                                "drop cp_kind"))
    if layout.moe_tp != "replicate" and not req.model.is_moe:
        out.append((CONSTRAINT, f"moe_tp={layout.moe_tp} splits mixture-of-experts blocks "
                                f"over tp, and {req.model.name} has none; drop moe_tp"))
    return out


# The trainer's rules name config keys; a plan names the layout's fields and its own
# options (--seq-len, --model), which is what its user can change.
_PLAN_WORDS = ((re.compile(r"--parallel\.(\w+)="), r"\1="),
               (re.compile(r"parallel\.(\w+)"), r"\1"),
               (re.compile(r"data\.seq_len"), "--seq-len"),
               (re.compile(r"--model\.name="), "--model "))


_TP_CHOICES = re.compile(r"a tp degree among \[([0-9, ]+)\]")


def _tp_choices_within(text: str, limit: int) -> str:
    """A rule's list of tp degrees cut to those a plan can use, at most `limit` (the
    GPUs of a node, where tensor parallelism is placed): a sequence of 8192 divides by
    every power of two up to 8192, but no node holds that many."""
    def within(match: re.Match) -> str:
        degrees = [d for d in (int(x) for x in match.group(1).split(",")) if d <= limit]
        return f"a tp degree among {degrees}"

    return _TP_CHOICES.sub(within, text)


def plan_words(text: str) -> str:
    """A layout rule's sentence in `partita plan`'s words."""
    for pattern, words in _PLAN_WORDS:
        text = pattern.sub(words, text)
    return text


def evaluate(req: Request, layout: Layout, timed: bool = True) -> Evaluation:
    """Judge `layout`: structural reasons first; then memory and time (always computed when
    the layout is well formed, so a rejected one still shows how far off it is).

    `timed=False` leaves the step time out (`add_step_time` adds it): a search times
    only the layouts it keeps, and whether one fits never depends on its time."""
    ev = Evaluation(layout, structural_reasons(req, layout), capacity=req.cluster.gpu.memory_bytes)
    if any(k == DIVISIBILITY for k, _ in ev.reasons):
        return ev
    m = num_microbatches(layout, req.global_batch)
    ev.compile = compile_in_effect(req.compile, layout, req.model.is_moe)
    if layout.zero_stage == 3 and req.keep_gathered is not None:
        ev.kept_units = (most_kept_units(req, layout, m, _judged_by(req, ev))
                         if req.keep_gathered == "auto" else int(req.keep_gathered))
    a = _judged_by(req, ev)
    ev.peak_stage, ev.memory = peak_memory(req.model, layout, req.seq_len, m, req.precision,
                                           a, req.cluster.gpu.runtime_reserved_bytes)
    ev.host_bytes_per_node = req.cluster.ranks_per_node * host_state_bytes(
        req.model, layout, req.precision, ev.peak_stage, a)
    ev.disk_bytes_per_node = req.cluster.ranks_per_node * disk_state_bytes(
        req.model, layout, req.precision, ev.peak_stage, a)
    ev.reasons += memory_reasons(req, ev)
    if timed:
        add_step_time(req, ev)
    return ev


def add_step_time(req: Request, ev: Evaluation) -> Evaluation:
    """`ev` with its step time, where it has a memory breakdown and no time yet (a layout
    that does not divide has neither), under the assumptions `evaluate` judged it by."""
    if ev.memory and not ev.time:
        ev.time = step_time(req.model, ev.layout, req.cluster, req.seq_len, req.global_batch,
                            req.precision, _judged_by(req, ev), compile=ev.compile)
    return ev


def _judged_by(req: Request, ev: Evaluation) -> Assumptions:
    """The assumptions `ev` is judged by: the request's, with its compile mode's
    activations and, once chosen, its ZeRO-3 kept units."""
    a = compiled_activations(req.assumptions, req.model, ev.compile)
    return a if ev.kept_units is None else with_kept_units(a, ev.kept_units)


def most_kept_units(req: Request, layout: Layout, m: int, assumptions: Assumptions) -> int:
    """The most ZeRO-3 units kept gathered into backward with which `layout` still fits
    in memory (at least 1, the engine's default); memory grows with the count."""
    def fits(k: int) -> bool:
        a = with_kept_units(assumptions, k)
        total = peak_memory(req.model, layout, req.seq_len, m, req.precision, a,
                            req.cluster.gpu.runtime_reserved_bytes)[1]["total"]
        return total <= req.cluster.gpu.memory_bytes

    lo, hi = 1, max(len(zero3_buffers(req.model, layout, req.precision, st, req.assumptions)
                        ["units"]) for st in range(layout.pp))
    while lo < hi:  # the largest k in [lo, hi] that fits (lo when none does)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


# One object per count in a search, not one per layout: memoised terms know it by identity.
@memoised()
def with_kept_units(assumptions: Assumptions, kept: int) -> Assumptions:
    """`assumptions` with ZeRO-3 keeping `kept` gather units into backward."""
    return replace(assumptions, zero3_kept_units=kept)


def _distinct_gb(need: float, have: float) -> tuple[str, str]:
    """`need` (one decimal at least) and `have` in GB, with as many decimals as it takes
    for an overflow not to read as equal (80.0 against 80 when 80.04 is needed)."""
    for digits in range(1, 10):
        need_text = f"{need / 1e9:.{digits}f}"
        have_text = f"{have / 1e9:.{digits}f}".rstrip("0").rstrip(".")
        if float(need_text) > float(have_text):
            return need_text, have_text
    return f"{need / 1e9:.9f}", f"{have / 1e9:.9f}"


def memory_reasons(req: Request, ev: Evaluation) -> list[tuple[str, str]]:
    gpu, out = req.cluster.gpu, []
    if ev.memory["total"] > gpu.memory_bytes:
        need, have = _distinct_gb(ev.memory["total"], gpu.memory_bytes)
        out.append((MEMORY, f"needs {need} GB per GPU on stage {ev.peak_stage}, "
                            f"{gpu.name} has {have} GB"))
    if ev.host_bytes_per_node > gpu.host_memory_per_node:
        out.append((MEMORY, f"offloaded states need {ev.host_bytes_per_node / 1e9:.0f} GB of "
                            f"host memory per node, a node has "
                            f"{gpu.host_memory_per_node / 1e9:.0f} GB"))
    return out
