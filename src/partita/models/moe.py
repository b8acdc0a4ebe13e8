"""A mixture-of-experts feed-forward: a router, E SwiGLU experts, optional shared experts.

Single-device code. Each token's router scores pick its top_k experts; the token runs
through them and their outputs are summed with the gate weights. The experts' weights
are stacked, one (E, ...) tensor per matrix, so that expert parallelism can hand each
rank a row block of them (experts first..first+n_local) and every expert runs as one
matmul over its tokens, never a Python loop over tokens.

How tokens reach the experts is the `dispatch` attribute: `LocalDispatch` (every expert
here) by default; expert parallelism swaps in an all-to-all dispatcher
(`partita.experts`) without touching this module.

Auxiliary losses, both per sequence and averaged over the batch's sequences (as
DeepSeek-V3's sequence-wise balance loss), so that the objective does not depend on how
a layout cuts the batch into replicas and microbatches:

- load balance (Switch/GShard): E * sum_e f_e * P_e, with f_e the share of the
  sequence's top_k choices that picked expert e and P_e its mean router probability;
- router z-loss (ST-MoE): the mean over tokens of logsumexp(router logits)^2.

They enter the gradient through `_AddAuxGrad` at the block's output (weights
`aux_loss_weight`, `z_loss_weight`), scaled like the main loss by `aux_grad_scale`
(loss scale / microbatches; the step runner sets it), so no loss function and no
pipeline stage needs to know about them. Capacity (`capacity_factor`) is counted per
sequence too: expert e takes at most C = ceil(factor * seq_len * top_k / E) of each
sequence's choices, first-choice slots before second-choice ones, earlier tokens first;
the others are dropped (their share of the output is zero), the same decisions on any
layout.

Under activation recomputation the forward runs once without a graph and again in
backward (`recompute_pass`): the statistics are summed in the first, the auxiliary
gradient enters through the rerun's graph, and the rerun routes identically (same
inputs, same weights, no randomness in routing or capacity).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from partita.eager_only import EagerOnly
from partita.errors import PartitaError
from partita.models import plan as roles
from partita.models.grouped_experts import grouped_swiglu
from partita.models.model_config import ModelConfig

# forced_route(tokens, top_k, n_experts) -> (tokens, top_k) expert indices: replaces the
# router's choice (tests: a balanced or a one-sided routing); gate weights still come
# from the router's probabilities of the chosen experts.
ForcedRoute = Callable[[int, int, int], torch.Tensor]


@dataclass
class Route:
    """Where each of N tokens goes: its top_k experts, gate weights, and which of the
    N x top_k choices are kept (None: dropless, all of them)."""

    experts: torch.Tensor  # (N, k) int64
    weights: torch.Tensor  # (N, k), the activations' dtype
    keep: torch.Tensor | None  # (N, k) bool


# The stacked weights of `Experts`, which parallel layouts cut along the expert dim.
EXPERT_PARAMS = ("w_gate", "w_up", "w_down")


class Experts(nn.Module):
    """`n_local` SwiGLU experts, global indices first..first+n_local-1, stacked."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.first, self.n_local = 0, n_experts
        self.w_gate = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w_up = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w_down = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: list[int],
                experts: list[int] | None = None) -> torch.Tensor:
        """x: consecutive row segments, counts[i] rows for local expert experts[i]
        (default: segment i for expert i). Every local expert must own a segment (0 rows
        allowed: the matmul still runs, so every expert's weights are in the graph on
        every rank). Expert parallelism passes segments by source rank, then expert,
        as they arrive: no regrouping copy on the way in nor on the way out."""
        if experts is None:
            experts = list(range(len(counts)))
        return grouped_swiglu(x, self.w_gate, self.w_up, self.w_down, counts, experts)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class LocalDispatch:
    """Every expert on this device: sort the kept choices by expert, run, scatter back."""

    def __call__(self, x: torch.Tensor, route: Route, experts: Experts) -> torch.Tensor:
        order, token, weight, counts = sort_by_expert(route, experts.n_local)
        y = experts(x.index_select(0, token), counts.tolist())
        return combine(y, token, weight, x)


def sort_by_expert(route: Route, n_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept choices grouped by expert (stable: token order within an expert):
    (their order, their token index, their gate weight, count per expert)."""
    n, k = route.experts.shape
    expert = route.experts.reshape(-1)
    token = torch.arange(n, device=expert.device).repeat_interleave(k)
    weight = route.weights.reshape(-1)
    if route.keep is not None:
        kept = route.keep.reshape(-1)
        expert, token, weight = expert[kept], token[kept], weight[kept]
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=n_experts)
    return order, token[order], weight[order], counts


def combine(y: torch.Tensor, token: torch.Tensor, weight: torch.Tensor,
            like: torch.Tensor) -> torch.Tensor:
    """Sum each token's expert outputs, scaled by their gate weights."""
    # In place on a fresh buffer: the out-of-place index_add would copy the zeros first.
    out = torch.zeros_like(like)
    return out.index_add_(0, token, y * weight.unsqueeze(1).to(y.dtype))


class _AddAuxGrad(torch.autograd.Function):
    """Identity on y; backward also gives `aux` the gradient `scale`, as if
    scale * aux had been added to the loss."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float64, device=grad.device), None


class MoEStats:
    """Sums over the forwards of one step (detached): what the log reports."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.reset()

    def reset(self) -> None:
        self.aux = 0.0  # sum over sequences of the balance loss
        self.z = 0.0  # sum over tokens of the z-loss
        self.sequences = 0
        self.tokens = 0
        self.dropped = 0
        self.counts = torch.zeros(self.n_experts, dtype=torch.float64, device="cpu")

    def add(self, aux_per_seq: torch.Tensor, z_per_token: torch.Tensor,
            chosen: torch.Tensor, keep: torch.Tensor | None) -> None:
        """One forward's losses and its route's choices (N, k) and kept choices."""
        self.aux += float(aux_per_seq.detach().sum())
        self.z += float(z_per_token.detach().sum())
        self.sequences += aux_per_seq.numel()
        self.tokens += z_per_token.numel()
        counts = torch.bincount(chosen.reshape(-1), minlength=self.n_experts)
        self.counts += counts.to("cpu", torch.float64)
        if keep is not None:
            self.dropped += int((~keep).sum())


class TensorEdges(Protocol):
    """Where an MoE feed-forward under tensor parallelism meets the rest of its block
    (`partita.tensor_parallel.moe`): under sequence parallelism it gathers the whole
    sequence on entry; when the tp ranks split the experts it sums their partial
    outputs on leaving."""

    def enter(self, x: torch.Tensor) -> torch.Tensor: ...

    def leave(self, y: torch.Tensor) -> torch.Tensor: ...


class ExpertShare(Protocol):
    """This tensor-parallel rank's share of the experts, when the tp ranks split them
    (`partita.tensor_parallel.moe.ExpertsOverTP`). Every tp rank routes the same tokens;
    each runs only the choices of experts first..first+count-1 (all of them when the
    ranks split each expert's width instead) with its slice of the shared experts'
    width, so its output is a partial sum."""

    first: int
    count: int

    def inputs(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]: ...


class OtherChunks(Protocol):
    """The other chunks of this rank's sequences, held by other ranks (implemented by
    `partita.context_parallel.moe_routing.SplitSequence`)."""

    parts: int  # the whole sequence is this many times the local one

    def total(self, x: torch.Tensor) -> torch.Tensor: ...

    def queue_positions(self, hot: torch.Tensor) -> torch.Tensor: ...


class MoE(nn.Module):
    """The feed-forward of an MoE block: (batch, seq, dim) -> (batch, seq, dim)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.expert_hidden)
        self.shared = (SwiGLU(cfg.dim, cfg.shared_experts * cfg.expert_hidden)
                       if cfg.shared_experts else None)
        self.dispatch: Callable[[torch.Tensor, Route, Experts], torch.Tensor] = LocalDispatch()
        self.aux_grad_scale = 1.0
        self.forced_route: ForcedRoute | None = None
        self.stats = MoEStats(cfg.n_experts)
        # Which pass activation recomputation runs (None: an ordinary forward).
        self.pass_name: str | None = None
        # Under tensor parallelism (`partita.tensor_parallel.moe`): `enter` gathers the
        # whole sequence before routing (sequence parallelism), `leave` keeps this rank's
        # shard of the output and sums the tp ranks' partial outputs (experts split over
        # tp). None: the input is already the whole sequence, the output complete.
        self.edges: TensorEdges | None = None
        # The tp ranks split the experts or their widths (parallel.moe_tp).
        self.share: ExpertShare | None = None
        # Under context parallelism (`partita.context_parallel.moe_routing`): the
        # per-sequence sums and queue places over every rank's chunks of the sequence.
        # None: this rank holds whole sequences.
        self.split: OtherChunks | None = None

    def recompute_pass(self, name: str | None) -> None:
        """Told by activation recomputation which pass runs: "forward" (the training
        forward, run without a graph), "rerun" (backward rebuilding it) or None."""
        self.pass_name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.edges is not None:
            return self.edges.leave(self._whole(self.edges.enter(x)))
        return self._whole(x)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        logits = self.router(flat)
        route, aux, z = self.route(logits, b, s)
        chosen, weights, keep = route.experts, route.weights, route.keep
        if self.share is not None:  # this tp rank's experts only: a partial output
            # The experts' inputs and gate weights get partial gradients here, summed
            # over tp by `inputs` in backward; the router's other paths are complete.
            flat, weights = self.share.inputs([flat, weights])
            if self.share.count < self.cfg.n_experts:  # not every expert is here
                chosen, keep = _own_choices(chosen, keep, self.share.first, self.share.count)
            x = flat.view(b, s, d)
        y = _dispatch(self.dispatch, flat, chosen, weights, keep, self.experts).view(b, s, d)
        if self.shared is not None:
            y = y + self.shared(x)
        training = torch.is_grad_enabled()
        # Statistics once per training forward: not in evaluation (no graph and no
        # recomputation), nor again when backward reruns this forward.
        if (training and self.pass_name is None) or self.pass_name == "forward":
            _record(self.stats, aux, z, route.experts, route.keep)
        if training:  # the graph that backward differentiates, first or rerun
            cfg = self.cfg
            if cfg.aux_loss_weight or cfg.z_loss_weight:
                total = cfg.aux_loss_weight * aux.mean() + cfg.z_loss_weight * z.mean()
                y = _AddAuxGrad.apply(y, total.to(torch.float64), self.aux_grad_scale)
        return y

    def route(self, logits: torch.Tensor, b: int, s: int
              ) -> tuple[Route, torch.Tensor, torch.Tensor]:
        """The tokens' route, the balance loss per sequence (b,), z-loss per token."""
        cfg, e, k = self.cfg, self.cfg.n_experts, self.cfg.top_k
        lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if cfg.router_gating == "sigmoid":
            scores = torch.sigmoid(lf)
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            scores = probs = torch.softmax(lf, dim=-1)
        if self.forced_route is not None:
            chosen = self.forced_route(b * s, k, e).to(logits.device)
        else:
            chosen = torch.topk(scores, k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if cfg.router_norm_topk and k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        keep = self._capacity(chosen, b, s) if cfg.capacity_factor is not None else None
        # Balance loss per sequence: share of choices f (no gradient) times mean prob P.
        counts = F.one_hot(chosen.view(b, s * k), e).sum(1).to(probs.dtype)  # (b, E)
        if self.split is None:
            share = counts / (s * k)
            aux = e * (share * probs.view(b, s, e).mean(1)).sum(-1)
        else:  # sums over the whole sequence, every rank holding part of it (one exchange)
            whole = s * self.split.parts
            sums = self.split.total(torch.cat((counts, probs.view(b, s, e).sum(1)), dim=1))
            aux = e * (sums[:, :e] / (whole * k) * sums[:, e:] / whole).sum(-1)
        z = torch.logsumexp(lf, dim=-1).square()
        return Route(chosen, weights.to(logits.dtype), keep), aux, z

    def _capacity(self, chosen: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """Which choices fit their expert's per-sequence capacity (see module docstring)."""
        e, k = self.cfg.n_experts, self.cfg.top_k
        whole = s * (self.split.parts if self.split is not None else 1)
        cap = math.ceil(self.cfg.capacity_factor * whole * k / e)
        # Priority order within a sequence: slot 0 of every token, then slot 1, ...
        ranked = chosen.view(b, s, k).transpose(1, 2).reshape(b, k * s)
        hot = F.one_hot(ranked, e)
        if self.split is None:
            position = (hot.cumsum(1) * hot).sum(-1) - 1  # place in its expert's queue
        else:
            position = self.split.queue_positions(hot.view(b, k, s, e)).view(b, k * s)
        keep = position < cap
        return keep.view(b, k, s).transpose(1, 2).reshape(b * s, k)


# A compiled MoE block (train.compile=blocks) runs these two eagerly between its compiled
# pieces (router and gates before, shared expert and combine after): the tokens each
# expert gets, so every shape inside the dispatch, change with the data, and the
# statistics read tensors into Python numbers. Route's fields travel one by one: a
# graph break hands plain tensors across.
@EagerOnly
def _dispatch(dispatch: Callable[[torch.Tensor, Route, Experts], torch.Tensor],
              x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
              keep: torch.Tensor | None, experts: Experts) -> torch.Tensor:
    return dispatch(x, Route(chosen, weights, keep), experts)


def _own_choices(chosen: torch.Tensor, keep: torch.Tensor | None, first: int,
                 count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The route's choices renumbered to experts first..first+count-1, and which of them
    this rank runs (kept ones of its own experts)."""
    local = chosen - first
    mine = (local >= 0) & (local < count)
    if keep is not None:
        mine = mine & keep
    return torch.where(mine, local, 0), mine


@EagerOnly
def _record(stats: MoEStats, aux: torch.Tensor, z: torch.Tensor, chosen: torch.Tensor,
            keep: torch.Tensor | None) -> None:
    stats.add(aux, z, chosen, keep)


def planned_moe_modules(model: nn.Module, plan: roles.ModelPlan) -> list[tuple[str, MoE]]:
    """Every module `plan` names as a mixture-of-experts feed-forward (role "moe"), with
    its name; PartitaError when one of them is not an `MoE`, which the parallel layers
    change in place."""
    found = [(n, m) for n, m in model.named_modules() if n and plan.role_of(n) == roles.MOE]
    wrong = [(n, m) for n, m in found if not isinstance(m, MoE)]
    if wrong:
        raise PartitaError(f"modules planned as 'moe' must be partita.models.moe.MoE; "
                           f"{wrong[0][0]} is {type(wrong[0][1]).__name__}.")
    return found


def moe_modules(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every MoE feed-forward of `model`, with its name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
