"""Which part of the model each pipeline stage holds, and how a stage runs forward.

The model is cut into p*v stages (p pipeline ranks, v virtual stages per rank; stage s
lives on rank s % p, see `Schedule`). Stages get contiguous runs of blocks from
`split_blocks`: even by default, or balanced by parameters or FLOPs with the embedding
counted on the first stage and the output head on the last.

A rank keeps only its stages' modules: the blocks it owns (the index-keyed ModuleDict
keeps their global names, `blocks.7`), every other root module with parameters (the
embeddings) on the first stage, the plan's head modules on the last. The rest are set
to None on the meta model, so they are never materialised.

Tied embeddings: the last stage needs the embedding matrix for its head. It keeps the
`tok_embeddings` module, and after tensor parallelism `detach_tied_copy` turns its
weight into a plain tensor — not a parameter, so the data-parallel engine, the
optimizer, the gradient norm and checkpoints see only the first stage's copy. The
runtime copies the first stage's weight into it each step and sends its gradient back
(see `partita.pipeline.tied`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from partita.errors import PartitaError
from partita.models.model_config import ModelConfig
from partita.models.plan import ModelPlan, shared_parameters
from partita.pipeline.actions import StageGrid
from partita.pipeline.split import split_blocks
from partita.sharding import mark_pipeline_stages

BALANCE_MODES = ("even", "params", "flops")
TIED_HEAD_ATTR = "weight"  # the attribute of plan.embedding the tied head reads


@dataclass(frozen=True)
class StageLayout(StageGrid):
    """Blocks of every global stage, for p ranks with v stages each."""

    n_ranks: int
    n_virtual: int
    blocks: tuple[range, ...]  # indexed by global stage
    tied: bool = False

    def describe(self) -> str:
        """'stage 0: blocks 0-1 (+embedding), stage 1: blocks 2-3 (+head)'."""
        parts = []
        for s, r in enumerate(self.blocks):
            extra = (" +embedding" if s == 0 else "") + (" +head" if s == self.last_stage else "")
            parts.append(f"stage {s}: blocks {r.start}-{r.stop - 1}{extra}")
        return ", ".join(parts)


def block_costs(cfg: ModelConfig, mode: str, seq_len: int) -> tuple[list[float] | None,
                                                                    float, float]:
    """(per-block cost, embedding extra, head extra) for a balance mode."""
    if mode not in BALANCE_MODES:
        raise PartitaError(
            f"pipeline balance '{mode}' is unknown; use one of {', '.join(BALANCE_MODES)} "
            "(even: same number of blocks per stage; params / flops: balance the heaviest "
            "stage, counting the embedding on the first and the head on the last)."
        )
    if mode == "even":
        return None, 0.0, 0.0
    if mode == "params":
        head = cfg.head_param_count() + (cfg.padded_vocab_size * cfg.dim if cfg.tie_embeddings
                                          else 0)
        return [float(cfg.block_param_count())] * cfg.n_layers, cfg.embedding_param_count(), head
    # FLOPs per token: 6 per matmul weight, plus attention's 12*H*Q*T; a lookup is free.
    attention = 12 * cfg.n_heads * cfg.head_dim * seq_len
    block = 6.0 * cfg.block_param_count() + attention
    return [block] * cfg.n_layers, 0.0, 6.0 * cfg.padded_vocab_size * cfg.dim


def plan_stages(cfg: ModelConfig, pp: int, virtual: int, balance: str = "even",
                seq_len: int | None = None) -> StageLayout:
    """Cut the model's blocks into pp*virtual stages; raises PartitaError if impossible."""
    costs, first, last = block_costs(cfg, balance, seq_len or cfg.max_seq_len)
    n_stages = pp * virtual
    if cfg.n_layers < n_stages:
        raise PartitaError(
            f"the model has {cfg.n_layers} blocks but parallel.pp={pp} x "
            f"parallel.virtual_stages={virtual} = {n_stages} pipeline stages; every stage "
            f"needs at least one block. Use at most {cfg.n_layers} stages in all (fewer "
            "virtual stages or a smaller pp), or a deeper model (model.n_layers)."
        )
    ranges = split_blocks(cfg.n_layers, n_stages, costs, first, last)
    return StageLayout(pp, virtual, tuple(ranges), tied=cfg.tie_embeddings)


def check_stage_model(model: nn.Module, plan: ModelPlan, layout: StageLayout) -> None:
    """Raise PartitaError, before anything is cut, for a model the pipeline cannot run
    in pieces: no index-keyed blocks matching the layout, no `embed` / `head` methods,
    or a parameter shared by modules on different stages. Every rank holds the same
    model, so every rank refuses alike, before any waits on another."""
    try:
        container: nn.Module | None = model.get_submodule(plan.blocks)
    except AttributeError:
        container = None
    kind = type(model).__name__
    n_blocks = sum(len(r) for r in layout.blocks)
    wanted = [str(i) for i in range(n_blocks)]
    if not isinstance(container, nn.ModuleDict) or list(container.keys()) != wanted:
        found = (f"{type(container).__name__} with keys {list(container.keys())[:8]}"
                 if isinstance(container, nn.ModuleDict)
                 else type(container).__name__ if container is not None else "nothing")
        raise PartitaError(
            f"pipeline parallelism cuts the model's blocks between stages by index, so "
            f"{kind}.{plan.blocks} (ModelPlan.blocks) must be an nn.ModuleDict with keys "
            f"'0'..'{n_blocks - 1}' (the plan's shape has n_layers={n_blocks}); it is "
            f"{found}. Keep the blocks in nn.ModuleDict({{str(i): block ...}}) under the "
            "name the plan gives, with as many as ModelPlan.shape.n_layers."
        )
    missing = [m for m in ("embed", "head") if not callable(getattr(model, m, None))]
    if missing:
        raise PartitaError(
            f"pipeline parallelism runs the model in pieces: model.embed(tokens) -> hidden "
            f"states on the first stage, the blocks in model.{plan.blocks} one after another "
            "(hidden states -> hidden states), and model.head(hidden) -> logits on the "
            f"last stage; {kind} has no {' and no '.join(m + '()' for m in missing)}. "
            "Give the model these two methods (its forward can then be head(blocks("
            "embed(tokens))), everything before the first block in embed and after the "
            "last in head), or train without pipeline parallelism (parallel.pp=1)."
        )
    for names in shared_parameters(model):
        stages = {name: _stage_of(name, plan, layout) for name in names}
        if len(set(stages.values())) > 1:
            where = ", ".join(f"{n} (stage {s})" for n, s in stages.items())
            raise PartitaError(
                f"one parameter is shared by modules on different pipeline stages: "
                f"{where}. Each stage would hold a copy of its own, and the copies would "
                "train apart. For tied input and output embeddings declare the tie in the "
                "plan, which the pipeline supports: leave the head module None on the "
                "model, compute the logits from the embedding's weight while it is None, "
                "name it in ModelPlan.tied_head and set tie_embeddings=True in "
                "ModelPlan.shape, as partita's Transformer does. Otherwise give each "
                "module a parameter of its own, or train without pipeline parallelism."
            )


def _stage_of(param_name: str, plan: ModelPlan, layout: StageLayout) -> int:
    """The global stage `keep_stages` puts a parameter on (by its name)."""
    if param_name.startswith(plan.blocks + "."):
        index = int(param_name[len(plan.blocks) + 1:].split(".")[0])
        return next(s for s, r in enumerate(layout.blocks) if index in r)
    return layout.last_stage if param_name.split(".")[0] in plan.head else 0


def keep_stages(model: nn.Module, plan: ModelPlan, layout: StageLayout, rank: int) -> None:
    """Drop (set to None / delete) every module this pipeline rank does not run."""
    mine = layout.stages_of(rank)
    mark_pipeline_stages(model, mine)  # for the data-parallel engine's check
    first, last = 0 in mine, layout.last_stage in mine
    keep = {str(b) for s in mine for b in layout.blocks[s]}
    container = model.get_submodule(plan.blocks)
    for key in list(container.keys()):
        if key not in keep:
            del container[key]
    for name, child, in_head in _outside_blocks(model, plan):
        if in_head:
            wanted = last
        elif any(True for _ in child.parameters()):
            # Input-side modules (token and position embeddings) run on the first stage;
            # a tied head also needs the token embedding on the last.
            wanted = first or (last and layout.tied and name == plan.embedding)
        else:
            continue  # parameterless (dropout): harmless to keep
        if not wanted:
            setattr(model, name, None)


def detach_tied_copy(model: nn.Module, plan: ModelPlan, layout: StageLayout,
                     rank: int) -> tuple[int, ...] | None:
    """On a last stage that is not also first, make the tied embedding weight a plain
    tensor (not a parameter). Returns its shape, or None when there is nothing to do.

    Call after tensor parallelism (which replaces the embedding module) and before
    materialisation; the runtime allocates and fills the tensor (`TiedHead`)."""
    mine = layout.stages_of(rank)
    if not layout.tied or 0 in mine or layout.last_stage not in mine:
        return None
    owner = model.get_submodule(plan.embedding)
    param = owner._parameters.pop(TIED_HEAD_ATTR)
    shape = tuple(param.shape)
    setattr(owner, TIED_HEAD_ATTR, torch.empty(shape, device="meta", dtype=param.dtype))
    return shape


@dataclass(frozen=True)
class LocalStage:
    """One stage held by this rank: its global index and what it runs."""

    index: int
    blocks: tuple[str, ...]  # keys in the blocks ModuleDict
    first: bool
    last: bool


def local_stages(layout: StageLayout, rank: int) -> list[LocalStage]:
    return [LocalStage(s, tuple(str(b) for b in layout.blocks[s]), s == 0,
                       s == layout.last_stage) for s in layout.stages_of(rank)]


def stage_parameters(model: nn.Module, plan: ModelPlan, stage: LocalStage) -> list[nn.Parameter]:
    """The trainable parameters one local stage runs: its blocks, the input side on the
    first stage and the head on the last (as `keep_stages` assigns them)."""
    container = model.get_submodule(plan.blocks)
    params = [p for key in stage.blocks for p in container[key].parameters()]
    for _, child, in_head in _outside_blocks(model, plan):
        if stage.last if in_head else stage.first:
            params += list(child.parameters())
    return [p for p in params if p.requires_grad]


def _outside_blocks(model: nn.Module, plan: ModelPlan) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, part of the head) of each present child other than the blocks."""
    return [(name, child, name in plan.head) for name, child in model.named_children()
            if name != plan.blocks and child is not None]


def embed(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The input side of the model (token and position embeddings, dropout)."""
    return model.embed(tokens)


def run_blocks(model: nn.Module, plan: ModelPlan, stage: LocalStage,
               x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """The stage's blocks; `segments`: documents of packed rows (None: one per row)."""
    container = model.get_submodule(plan.blocks)
    for key in stage.blocks:
        x = container[key](x) if segments is None else container[key](x, segments=segments)
    return x


def head(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The output side of the model: final norm and logits (tied or not)."""
    return model.head(x)
