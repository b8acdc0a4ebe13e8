"""Every reason a layout cannot run on a model and a world.

`find_problems` lists every reason a `Layout` (partita.layout) cannot train a model on a
world and a batch; `validate` raises them all at once. The command line calls it before
launching, each worker calls it before any process waits on another, and the planner
calls it so that it never ranks a layout `partita train` refuses. One function per
dimension below; each problem says what to change.

Pure data: no torch, no process group, so the planner and the launcher can use it.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, NamedTuple

from partita.errors import PartitaError, process_count_option
from partita.layout import divisors

if TYPE_CHECKING:  # only fields are read; importing `partita.models` loads torch
    from partita.layout import Degrees, Layout
    from partita.models.model_config import ModelConfig

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


class Problem(NamedTuple):
    """One reason a layout cannot run: its kind and a sentence that says what to change."""

    kind: str
    message: str


def find_problems(layout: Layout, model: ModelConfig, world_size: int, *, seq_len: int,
                  global_batch: int, planner: bool = False) -> list[Problem]:
    """Every reason `layout` cannot train `model` on `world_size` processes with
    `global_batch` sequences of `seq_len` tokens per step; empty when it can.
    `planner`: the world and the batch are named by `partita plan`'s options (--gpus,
    --layout, --global-batch), not by `partita train`'s."""
    out: list[Problem] = []
    lay = layout
    if lay.world_size != world_size:
        out.append(Problem(DIVISIBILITY, world_size_message(lay.degrees, world_size, planner)))
    out += _experts(lay, model)
    out += _recompute(lay, model)
    out += _tensor_parallel(lay, model, seq_len)
    out += _pipeline(lay, model)
    out += _batch(lay, global_batch, planner)
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


def world_size_message(degrees: Degrees, world_size: int, planner: bool = False,
                       library: bool = False) -> str:
    """Why `degrees` do not fill `world_size` processes, and what to change, in
    `partita train`'s options, (`planner`) in `partita plan`'s, or (`library`) in the
    arguments of a `Mesh` built in Python."""
    d = degrees
    other = d.tp * d.pp * d.cp
    if library:
        layout = f"Degrees(dp={d.dp}, tp={d.tp}, pp={d.pp}, cp={d.cp})"
        fit = (f"dp={world_size // other}" if world_size % other == 0 else
               f"tp x pp x cp = {other} does not divide {world_size}: change tp, pp or cp")
        return (f"{layout} needs {d.world_size} processes, but the Mesh is built with "
                f"world_size={world_size}. Start {d.world_size} processes (torchrun "
                f"--nproc-per-node {d.world_size}), or choose degrees whose product is "
                f"{world_size} ({fit}).")
    take_rest = ("dp left out" if planner else "--parallel.dp=0") + (
        ", which takes what tp x pp x cp leave")
    if world_size % other == 0:
        dp = f"dp={world_size // other}"
        change = f"--layout {dp}" if planner else f"--parallel.{dp}"
        change += f" (or {take_rest})"
    else:
        change = (f"tp x pp x cp = {other} does not divide {world_size}, so change tp, pp "
                  f"or cp, with {take_rest}")
    if planner:
        wanted = (f"{d.world_size} GPUs but --gpus is {world_size}. Plan for --gpus "
                  f"{d.world_size}")
    else:
        wanted = (f"{d.world_size} processes but {world_size} were started. Start "
                  f"{d.world_size} processes ({process_count_option(d.world_size)})")
    return (f"the layout dp={d.dp} x tp={d.tp} x pp={d.pp} x cp={d.cp} needs {wanted}, "
            f"or choose degrees whose product is {world_size}: {change}.")


def _experts(lay: Layout, model: ModelConfig) -> list[Problem]:
    """Expert parallelism needs MoE blocks whose experts split evenly over ep; splitting
    them over tp too needs E divisible by tp x ep (moe_tp=experts) or each expert's width
    by tp (moe_tp=hidden), and a shared-expert width of at least tp."""
    out, ep, n_experts = [], lay.ep, getattr(model, "n_experts", 0)
    if ep > 1 and not n_experts:
        out.append(Problem(CONSTRAINT, f"parallel.ep={ep} spreads experts over ranks, but "
                                       "the model has no MoE blocks; set parallel.ep=1, or "
                                       "use an MoE model (model.n_experts > 0, e.g. "
                                       "--model.name=tiny-moe)."))
    elif ep > 1 and n_experts % ep:
        ok = [d for d in divisors(n_experts) if (lay.dp * lay.cp) % d == 0]
        out.append(Problem(DIVISIBILITY, f"model.n_experts={n_experts} is not divisible by "
                                         f"parallel.ep={ep}: every expert-parallel rank holds "
                                         f"as many experts. Use ep among {ok}, or a number "
                                         f"of experts divisible by {ep}."))
    if lay.moe_tp == "replicate" or lay.tp == 1 or not n_experts:
        return out
    shared = model.shared_experts * model.expert_hidden
    if shared and shared < lay.tp:
        out.append(Problem(DIVISIBILITY, f"parallel.moe_tp={lay.moe_tp} splits the shared "
                                         f"experts' width over tp, but it is {shared} < tp="
                                         f"{lay.tp}; use parallel.moe_tp=replicate."))
    if lay.moe_tp == "experts" and n_experts % (lay.tp * ep):
        out.append(Problem(DIVISIBILITY, f"parallel.moe_tp=experts splits the experts over "
                                         f"tp x ep = {lay.tp * ep} ranks, but "
                                         f"model.n_experts={n_experts} is not divisible by "
                                         f"{lay.tp * ep}. Use parallel.moe_tp=hidden or "
                                         "replicate, or degrees whose product divides "
                                         f"{n_experts}."))
    if lay.moe_tp == "hidden" and model.expert_hidden % lay.tp:
        out.append(Problem(DIVISIBILITY, f"parallel.moe_tp=hidden splits each expert's width "
                                         f"over tp, but the expert width "
                                         f"{model.expert_hidden} is not divisible by tp="
                                         f"{lay.tp}; use parallel.moe_tp=experts or "
                                         "replicate, or another model.expert_ffn_dim."))
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
                                         f"{tp}, or a tp degree among {divisors(seq_len)}."))
    if tp == 1:
        return out
    if model.n_heads % tp:
        out.append(Problem(DIVISIBILITY, f"model.n_heads={model.n_heads} is not divisible by "
                                         f"tp={tp}: attention is split by heads, so every rank "
                                         "needs the same number of whole heads. Valid tp "
                                         f"degrees: {divisors(model.n_heads)}."))
    # The stored vocabulary, padded to model.vocab_multiple, is what tp splits.
    vocab = model.padded_vocab_size
    for n, what in ((model.ffn_hidden, "model ffn hidden width"),
                    (vocab, "model.vocab_size" if vocab == model.vocab_size
                     else "the padded vocabulary")):
        if not _padded_split_ok(n, tp):
            # The first 12 valid degrees, and whether there are more.
            ok = list(itertools.islice((t for t in range(1, min(n, 4096) + 1)
                                        if _padded_split_ok(n, t)), 13))
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
    if lay.pp > 1 and lay.schedule == "interleaved-1f1b" and v < 2:
        out.append(Problem(CONSTRAINT, "parallel.schedule=interleaved-1f1b with "
                                       f"parallel.virtual_stages={v} has nothing to interleave "
                                       "(it would run as plain 1F1B under another name); set "
                                       "virtual_stages=2 or more (0 takes the default, 2), or "
                                       "parallel.schedule=1f1b."))
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


def _batch(lay: Layout, global_batch: int, planner: bool = False) -> list[Problem]:
    # partita plan sets the batch with --global-batch and the microbatch by its size in
    # the layout; partita train with train.global_batch and train.microbatches.
    batch = f"--global-batch {global_batch}" if planner else f"train.global_batch={global_batch}"
    if global_batch < 1 or global_batch % lay.dp:
        return [Problem(DIVISIBILITY, f"{batch} is not divisible by the {lay.dp} "
                                      f"data-parallel replicas; choose a multiple of "
                                      f"{lay.dp}.")]
    local = global_batch // lay.dp
    if local % lay.microbatch_size:
        if planner:
            fix = (f"choose a microbatch_size that divides {local} (at most {local}), or "
                   f"a --global-batch that is a multiple of dp x microbatch_size = "
                   f"{lay.dp * lay.microbatch_size}")
        else:
            fix = (f"choose a number of microbatches (train.microbatches) that divides "
                   f"{local}")
        return [Problem(DIVISIBILITY, f"each replica's batch of {local} sequences cannot be "
                                      f"cut into microbatches of {lay.microbatch_size} "
                                      f"sequences; {fix}.")]
    m = local // lay.microbatch_size
    if lay.pp > 1 and lay.schedule == "interleaved-1f1b" and m % lay.pp:
        lower, upper = (m // lay.pp) * lay.pp, (m // lay.pp + 1) * lay.pp
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        return [Problem(CONSTRAINT, f"interleaved-1f1b sends microbatches round the {lay.pp} "
                                    f"pipeline stages in groups of {lay.pp}, so the number "
                                    f"of microbatches must be a multiple of {lay.pp}; got "
                                    f"{m}. Use {hint} microbatches ("
                                    + ("--global-batch = dp x microbatch_size x microbatches"
                                       if planner else "train.microbatches")
                                    + "), or the 1f1b schedule.")]
    return []
