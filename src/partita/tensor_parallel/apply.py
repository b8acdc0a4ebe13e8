"""Apply tensor (and sequence) parallelism to a model from its plan, then verify it.

    report = apply_tensor_parallel(model, model.plan(), mesh.comm("tensor"))
    loss = report.loss_fn(model(tokens), targets)

Modules are swapped in place; parameter names stay those of the single-device model and
every parameter gets a ShardInfo (split ones: which slice; the rest: replicated over
"tensor"). On a meta-device model the new parameters are meta tensors of the local
shapes, to be materialised with `partita.sharding.init_shard(plan.init, shard_info(p))`; on a
model with values the shards are sliced from them.

Recognised by the plan's roles: COLWISE/ROWWISE nn.Linear (split on head boundaries
when the parent module has a `head_dim`, i.e. is attention), VOCAB_EMBEDDING
nn.Embedding, VOCAB_HEAD nn.Linear, NORM any module, POSITIONS an nn.Embedding
(sequence-sharded under sequence parallelism), MOE a mixture-of-experts feed-forward
(replicated, or its experts split over tp: `moe_tp`, see moe.py; under sequence
parallelism it computes on the gathered sequence). A tied
head (`plan.tied_head`, None on the model) is built from the vocab-parallel embedding;
every nn.Dropout becomes a ParallelDropout (see dropout.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from partita.comm import GroupComm
from partita.errors import PartitaError
from partita.layout import MOE_TP
from partita.models import plan as roles
from partita.models.moe import planned_moe_modules
from partita.sharding import ShardInfo, has_shard_info, set_shard_info
from partita.tensor_parallel import partition as part
from partita.tensor_parallel.dropout import ParallelDropout, RegionRNG
from partita.tensor_parallel.layers import (
    ColumnParallelLinear,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    region_pre_hook,
)
from partita.tensor_parallel.moe import SummedOutput, WholeSequence, split_moe_over_tp
from partita.tensor_parallel.plan_check import check_plan
from partita.tensor_parallel.sequence import SequenceParallelNorm, SequenceShardedPositions
from partita.tensor_parallel.vocab import (
    VocabParallelEmbedding,
    VocabParallelHead,
    VocabParallelLoss,
)

REPLICATED = ("tensor",)
_PARALLEL_TYPES = (ColumnParallelLinear, RowParallelLinear, ReplicatedHeadsLinear,
                   VocabParallelEmbedding, VocabParallelHead, SequenceParallelNorm,
                   SequenceShardedPositions)


@dataclass
class TensorParallelReport:
    """What apply_tensor_parallel did; `loss_fn(logits, targets)` is the model's loss."""

    tp: int
    sequence_parallel: bool
    parallel: dict[str, str] = field(default_factory=dict)  # module name -> new type
    replicated: list[str] = field(default_factory=list)  # parameter names
    notes: list[str] = field(default_factory=list)  # exact adjustments made
    vocab_size: int = 0  # the real vocabulary (the plan's), which the loss counts
    padded_vocab_size: int = 0  # the split rows, padded to a multiple of tp
    loss_fn: VocabParallelLoss | None = None


def apply_tensor_parallel(model: nn.Module, plan: roles.ModelPlan, comm: GroupComm,
                          sequence_parallel: bool = False,
                          dropout_seed: int = 0,
                          moe_tp: str = "replicate") -> TensorParallelReport:
    """Swap the planned modules of `model` for tensor-parallel ones over `comm`.

    Raises PartitaError for a layout the model cannot take (names the valid tp degrees),
    for a plan whose split layers lack their partners or share a parameter with another
    module (plan_check.py), and for planned modules left without a parallel type. `dropout_seed` seeds the
    dropout generators; make it differ across data-parallel ranks. `moe_tp` says how
    MoE feed-forwards use the tp group ("replicate", "experts" or "hidden", see moe.py).
    """
    tp = comm.size
    if moe_tp not in MOE_TP:
        raise PartitaError(f"parallel.moe_tp={moe_tp!r} is unknown; choose one of "
                           f"{', '.join(MOE_TP)}.")
    if sequence_parallel and tp == 1:
        raise PartitaError(
            "sequence parallelism shards activations over the tensor-parallel group, but "
            "its size is 1. Set parallel.tp to 2 or more, or turn sequence parallelism off."
        )
    done = [n for n, m in model.named_modules() if isinstance(m, _PARALLEL_TYPES)]
    if done:
        # A second pass would add a second region entry per block: gradients reduced twice.
        raise PartitaError(
            f"tensor parallelism is already applied to this model ({done[0]} is a "
            f"{type(model.get_submodule(done[0])).__name__}); apply it once, to a model "
            "built from its single-device definition."
        )
    # Before any module changes: a plan mistake then reads as one, not as a shape error.
    check_plan(model, plan, moe_tp)
    report = TensorParallelReport(tp=tp, sequence_parallel=sequence_parallel)
    ctx = _Context(comm, sequence_parallel, plan.shape, report, moe_tp)
    planned = [(n, m, plan.role_of(n)) for n, m in model.named_modules() if n]
    planned = [(n, m, r) for n, m, r in planned if r is not None]
    region_parents: dict[str, nn.Module] = {}
    for name, module, role in planned:
        new = ctx.convert(name, module, role, _parent(model, name))
        if new is not module:
            _replace(model, name, new)
        if role == roles.COLWISE:
            parent_name = name.rpartition(".")[0]
            region_parents[parent_name] = model.get_submodule(parent_name)
    for parent in region_parents.values():
        # prepend: the region is entered before any pre-hook the model installed itself,
        # so those see what the module computes on (the whole sequence under SP).
        parent.register_forward_pre_hook(region_pre_hook(comm, sequence_parallel),
                                         with_kwargs=True, prepend=True)
    split = moe_tp != "replicate" and tp > 1  # each tp rank computes a partial output
    for name, moe in planned_moe_modules(model, plan):
        if sequence_parallel:  # computes on the gathered sequence
            moe.edges = WholeSequence(comm, summed=split)
        elif split:
            moe.edges = SummedOutput(comm)
        report.parallel[name] = (f"split over tp ({moe_tp})" if split else "replicated") + (
            ", on the whole sequence" if sequence_parallel else "")
    _tie_head(model, plan, ctx)
    _dropouts(model, RegionRNG(dropout_seed, comm.index), set(region_parents), ctx)
    _mark_replicated(model, ctx)
    verify_tensor_parallel(model, plan, sequence_parallel)
    return report


def verify_tensor_parallel(model: nn.Module, plan: roles.ModelPlan,
                           sequence_parallel: bool) -> None:
    """Raise PartitaError naming every planned module that lacks its parallel type."""
    expected = {
        roles.COLWISE: (ColumnParallelLinear, ReplicatedHeadsLinear),
        roles.ROWWISE: (RowParallelLinear,),
        roles.VOCAB_EMBEDDING: (VocabParallelEmbedding,),
        roles.VOCAB_HEAD: (VocabParallelHead,),
        roles.NORM: (SequenceParallelNorm,) if sequence_parallel else (nn.Module,),
        roles.POSITIONS: (SequenceShardedPositions,) if sequence_parallel else (nn.Embedding,),
        roles.ATTENTION_CORE: (nn.Module,),  # parameter-free: computes on local heads as is
    }
    wrong = [f"{n} ({r}: {type(m).__name__})" for n, m in model.named_modules()
             if n and (r := plan.role_of(n)) is not None
             and not isinstance(m, expected.get(r, nn.Module))]
    if wrong:
        raise PartitaError(
            "tensor parallelism left these planned modules without a parallel type: "
            + ", ".join(wrong) + ". Each would silently compute on unsplit or partial data. "
            "Give them a supported type (nn.Linear for colwise/rowwise/vocab_head, "
            "nn.Embedding for vocab_embedding) or remove them from the model's plan."
        )


class _Context:
    def __init__(self, comm: GroupComm, sequence_parallel: bool, cfg, report,
                 moe_tp: str = "replicate") -> None:
        self.comm, self.sp, self.cfg, self.report = comm, sequence_parallel, cfg, report
        self.moe_tp = moe_tp
        self.tp, self.index = comm.size, comm.index
        self.vocab: VocabParallelEmbedding | None = None

    def note(self, text: str) -> None:
        if text not in self.report.notes:
            self.report.notes.append(text)

    def split(self, module: nn.Module, name: str, attr: str, dim: int, start: int,
              stop: int, full: int) -> None:
        """Record that module.attr holds [start, stop) of a global size `full` along dim."""
        param = getattr(module, attr, None)
        if param is not None:
            shape = list(param.shape)
            shape[dim] = full
            set_shard_info(param, ShardInfo(f"{name}.{attr}", tuple(shape), dim, start, stop))

    def replicate(self, name: str, param: nn.Parameter) -> None:
        set_shard_info(param, ShardInfo(name, tuple(param.shape), replicated_over=REPLICATED))
        self.report.replicated.append(name)

    def convert(self, name: str, module: nn.Module, role: str, parent: nn.Module) -> nn.Module:
        linear = isinstance(module, nn.Linear)
        head_dim = getattr(parent, "head_dim", None)
        if role == roles.COLWISE and linear:
            if head_dim:
                return self._attention_column(name, module, head_dim)
            start, stop = self._padded(module.out_features, f"{name} output features")
            new = ColumnParallelLinear(module, start, stop, self.comm, self.sp)
            self.split(new, name, "weight", 0, start, stop, module.out_features)
            self.split(new, name, "bias", 0, start, stop, module.out_features)
        elif role == roles.ROWWISE and linear:
            if head_dim:
                heads = module.in_features // head_dim
                first, last = part.head_split(heads, self.tp, self.index, f"{name} heads")
                start, stop = first * head_dim, last * head_dim
            else:
                start, stop = self._padded(module.in_features, f"{name} input features")
            new = RowParallelLinear(module, start, stop, self.comm, self.sp)
            self.split(new, name, "weight", 1, start, stop, module.in_features)
            if new.bias is not None:
                self.replicate(f"{name}.bias", new.bias)
        elif role in (roles.VOCAB_EMBEDDING, roles.VOCAB_HEAD):
            rows = module.num_embeddings if isinstance(module, nn.Embedding) else (
                module.out_features if linear else None)
            if rows is None or (role == roles.VOCAB_EMBEDDING) != isinstance(module, nn.Embedding):
                return module  # unsupported type: reported by verify_tensor_parallel
            # The module's rows are what is split: a model's padded vocabulary
            # (model.vocab_multiple) when it has one. The loss needs the real vocabulary,
            # from the plan's shape: logit columns past it are padding, never a target.
            start, stop = self._padded(rows, "vocabulary")
            padded = part.padded_size(rows, self.tp) // self.tp
            real = rows if self.cfg is None else min(rows, self.cfg.vocab_size)
            self.report.vocab_size, self.report.padded_vocab_size = real, padded * self.tp
            if role == roles.VOCAB_EMBEDDING:
                new = self.vocab = VocabParallelEmbedding(module, start, stop, padded,
                                                          self.comm, self.sp)
            else:
                new = VocabParallelHead(module, start, stop, padded, self.comm, self.sp)
                if module.bias is not None:
                    raise PartitaError(f"{name}: a vocabulary head with a bias is not supported.")
            self.split(new, name, "weight", 0, start, stop, rows)
            self.report.loss_fn = VocabParallelLoss(self.comm, start, real)
        elif role == roles.NORM:
            for pname, param in module.named_parameters(recurse=False):
                self.replicate(f"{name}.{pname}", param)
            new = SequenceParallelNorm(module, self.comm) if self.sp else module
        elif role == roles.MOE:
            # Every tp rank routes the same tokens (docs/expert_parallel.md); with
            # moe_tp "experts" or "hidden" each keeps its share of the experts (moe.py).
            if self.moe_tp != "replicate" and self.tp > 1:
                split_moe_over_tp(name, module, self.comm, self.moe_tp)
            for pname, param in module.named_parameters():
                if not has_shard_info(param):
                    self.replicate(f"{name}.{pname}", param)
            return module
        elif role == roles.POSITIONS and isinstance(module, nn.Embedding):
            for pname, param in module.named_parameters(recurse=False):
                self.replicate(f"{name}.{pname}", param)
            if not self.sp:
                return module
            new = SequenceShardedPositions(module, self.comm)
        else:
            return module
        self.report.parallel[name] = type(new).__name__
        return new

    def _padded(self, n: int, what: str) -> tuple[int, int]:
        part.check_padded_split(n, self.tp, what)
        if n % self.tp:
            self.note(f"{what}: {n} padded to {part.padded_size(n, self.tp)} for tp={self.tp} "
                      "(exact; the padding is not stored)")
        return part.padded_split(n, self.tp, self.index)

    def _attention_column(self, name: str, module: nn.Linear, head_dim: int) -> nn.Module:
        heads = module.out_features // head_dim
        n_heads = self.cfg.n_heads if self.cfg is not None else heads
        if heads % self.tp == 0 or heads >= n_heads:
            first, last = part.head_split(heads, self.tp, self.index, f"{name} heads")
            new = ColumnParallelLinear(module, first * head_dim, last * head_dim,
                                       self.comm, self.sp)
            lo, hi, full = first * head_dim, last * head_dim, module.out_features
            self.split(new, name, "weight", 0, lo, hi, full)
            self.split(new, name, "bias", 0, lo, hi, full)
        else:  # grouped-query kv heads that tp does not divide: keep them all
            q_first, q_last = part.head_split(n_heads, self.tp, self.index)
            kv = part.kv_rows_for_rank(n_heads, heads, q_first, q_last)
            new = ReplicatedHeadsLinear(module, kv, head_dim, self.comm, self.sp)
            for pname, param in new.named_parameters(recurse=False):
                self.replicate(f"{name}.{pname}", param)
            self.note(f"kv heads ({heads}) not divisible by tp={self.tp}: kv projections "
                      "replicated on every tp rank, gradients summed over tp")
        self.report.parallel[name] = type(new).__name__
        return new


def _tie_head(model: nn.Module, plan: roles.ModelPlan, ctx: _Context) -> None:
    """Tied embeddings: the vocab-parallel embedding shard doubles as the head shard."""
    name = plan.tied_head
    if name is None or getattr(model, name, "absent") is not None or ctx.vocab is None:
        return
    v = ctx.vocab
    setattr(model, name, VocabParallelHead(None, v.start, v.stop, v.padded_rows, ctx.comm,
                                           ctx.sp, tied=v))
    ctx.report.parallel[name] = "VocabParallelHead (tied)"


def _dropouts(model: nn.Module, rng: RegionRNG, region_parents: set[str],
              ctx: _Context) -> None:
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Dropout):
            inside = name.rpartition(".")[0] in region_parents
            kind = "split" if inside or ctx.sp else "replicated"
            _replace(model, name, ParallelDropout(module.p, rng, kind))


def _mark_replicated(model: nn.Module, ctx: _Context) -> None:
    """Give every unsplit parameter a ShardInfo; refuse unknown ones under SP."""
    unknown = []
    for name, param in model.named_parameters():
        if not has_shard_info(param):
            ctx.replicate(name, param)
            unknown.append(name)
    if ctx.sp and unknown:
        raise PartitaError(
            "under sequence parallelism these parameters are outside the model's plan: "
            + ", ".join(unknown) + ". They would see sequence shards and get partial "
            "gradients. Add them to the plan (for example as 'norm') or turn sequence "
            "parallelism off."
        )


def _parent(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0])


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)
