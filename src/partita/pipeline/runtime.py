"""Run a pipeline schedule: this rank's actions, in order, for one training step.

`PipelineRunner` is a `parallelize.StepRunner`: `train` returns this rank's share of the
loss (sum over microbatches of loss / microbatches on the last stage, 0.0 elsewhere) and
leaves gradients in `.grad` for the data-parallel engine; `evaluate` has no backward.
Each microbatch's loss is divided by the number of microbatches here and multiplied by
the engine's loss scale (1 unless float16); nothing else rescales a gradient. Every
action's start and end are recorded (`timeline`) to draw a run and measure its bubble.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from partita.loss import check_microbatches, microbatch_weight
from partita.mesh import Mesh
from partita.models.plan import VOCAB_HEAD, ModelPlan
from partita.pipeline import stage as st
from partita.pipeline.actions import (
    Action,
    Kind,
    Schedule,
    deferred_weight_passes,
    final_backwards,
    split_backwards,
)
from partita.pipeline.backward import (
    ForwardSaves,
    WeightPass,
    as_edge,
    backward_input,
    full_backward,
)
from partita.pipeline.p2p import Transport, delivery_proofs, neighbour_pairs, validated_schedule
from partita.pipeline.schedules import forward_only
from partita.pipeline.simulate import Event
from partita.pipeline.tied import TiedHead


@dataclass
class _Pass:
    """What (stage, microbatch) keeps between its forward and its backward."""

    x: torch.Tensor | None = None  # stage input (a leaf), or stage 0's embedding output
    embedded: torch.Tensor | None = None  # stage 0: embedding before the detach
    root: torch.Tensor | None = None  # the loss (last stage); else None, see `edge`
    edge: object = None  # GradientEdge of the output: the tensor itself may be freed
    weights: WeightPass | None = None
    x_grad: torch.Tensor | None = None  # stage 0 after I: gradient at the detach
    saves: ForwardSaves | None = None  # split backward: what I may release (backward.py)

    @property
    def deferred_bytes(self) -> int:
        """Held from I to W outside the saved tensors: the gradients I recorded (and on
        stage 0 the one at the embedding's detach)."""
        held = self.weights.nbytes if self.weights is not None else 0
        if self.x_grad is not None:
            held += self.x_grad.numel() * self.x_grad.element_size()
        return held


@dataclass
class _Step:
    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    m: int
    train: bool
    # (stage, microbatch) whose W does not follow its I at once: their forwards run
    # inside `ForwardSaves`, so I can release what W will not read.
    deferred: frozenset[tuple[int, int]] = frozenset()
    # (stage, microbatch) whose backward runs as I and W (any zero-bubble split): on
    # stage 0 those detach the embedding's output, so W can run the embedding's backward.
    split: frozenset[tuple[int, int]] = frozenset()
    passes: dict[tuple[int, int], _Pass] = field(default_factory=dict)
    outbox: dict[Action, torch.Tensor] = field(default_factory=dict)  # to send / hand over
    inbox: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    held: dict[int, int] = field(default_factory=dict)  # per stage: len of its passes
    # Zero bubble, last stage: output-projection weight passes waiting to run right
    # after the next sends are posted, and the step's sum of their gradients.
    early: list[tuple[Action, WeightPass]] = field(default_factory=list)
    early_grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Per microbatch, the document of every token of packed rows (None: one per row).
    segments: list[torch.Tensor] | None = None
    # The step's trained targets per loss-averaging rank (partita.loss.microbatch_weight).
    targets_per_rank: float | None = None


@dataclass(frozen=True)
class _RankRun:
    """One schedule as this rank runs it, with what is worked out from it once (per
    microbatch count, for training and for evaluation), not on every step."""

    actions: tuple[Action, ...]
    final: dict[int, Action]  # per local stage, its last B or W of the step
    deferred: frozenset[tuple[int, int]]  # see _Step
    split: frozenset[tuple[int, int]]  # see _Step
    # Which of this rank's receives proves each send delivered (gloo; p2p.py).
    proofs: dict[Action, Action]
    # Per action index, the receives to post just before it (`_early_receives`); None
    # where the transport posts receives only when reached (NCCL).
    early: list[tuple[Action, ...]] | None


def _chunks(segments: torch.Tensor | None, m: int) -> list[torch.Tensor] | None:
    return None if segments is None else list(segments.chunk(m))


class PipelineRunner:
    """Executes schedules on this rank's stages of `dp.module`."""

    def __init__(self, dp, loss_fn, device: torch.device, mesh: Mesh, plan: ModelPlan,
                 layout: st.StageLayout, schedule: Schedule, seq_len: int, dim: int,
                 seq_divisor: int = 1, timeout_s: float = 300.0) -> None:
        """`schedule` is the step's schedule, already validated (`pipeline.build`)."""
        self.dp, self.loss_fn, self.device, self.plan = dp, loss_fn, device, plan
        self.layout = layout
        self.schedule_name, self.virtual = schedule.name, schedule.n_virtual
        self.microbatches = schedule.n_microbatches
        self.rank = mesh.coord.pp
        comm = mesh.comm("pipeline")
        self.transport = Transport(comm, lambda s: comm.ranks[layout.rank_of(s)],
                                   timeout_s, self.rank,
                                   neighbour_pairs(layout.n_stages, layout.rank_of))
        self.stages = {s.index: s for s in st.local_stages(layout, self.rank)}
        self.seq_len, self.dim, self.seq_divisor = seq_len, dim, seq_divisor
        module = dp.module
        self.dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
        self.tied = self._tied_head(mesh, timeout_s)
        # With several stages on this rank, each backward reaches one stage's parameters
        # and the engine reduces a stage's buckets during its last backward of the step.
        self.stage_buckets = ({i: dp.buckets_of(st.stage_parameters(module, plan, s))
                               for i, s in self.stages.items()}
                              if len(self.stages) > 1 else {})
        # Other counts (an evaluation batch that does not divide) are built on demand.
        self._schedules: dict[int, Schedule] = {schedule.n_microbatches: schedule}
        # Per microbatch count, training's and evaluation's run of this rank.
        self._train_runs: dict[int, _RankRun] = {}
        self._eval_runs: dict[int, _RankRun] = {}
        self.timeline: list[Event] = []  # last training step, seconds from its start
        self.step_started = 0.0  # time.perf_counter() at the last step's start
        # Per local stage, the most microbatches whose activations were held at once
        # during the last training step (counted from the runtime's own state).
        self.held_peak: dict[int, int] = {}
        # Zero bubble: bytes of the gradients I recorded and W has not consumed yet (held
        # for backward like saved activations, but outside autograd's saved tensors).
        self.deferred_bytes = 0
        self.early_params = self._early_weight_params()

    @property
    def module(self) -> nn.Module:
        return self.dp.module

    def _tied_head(self, mesh: Mesh, timeout_s: float) -> TiedHead | None:
        if not self.layout.tied:
            return None
        first, last = 0 in self.stages, self.layout.last_stage in self.stages
        if not (first or last):
            return None
        owner = self.module.get_submodule(self.plan.embedding)
        if first:
            return TiedHead(mesh.comm("embedding"), getattr(owner, st.TIED_HEAD_ATTR), True,
                            timeout_s)
        meta = getattr(owner, st.TIED_HEAD_ATTR)
        copy = torch.zeros(meta.shape, dtype=self.dtype, device=self.device,
                           requires_grad=True)
        setattr(owner, st.TIED_HEAD_ATTR, copy)
        return TiedHead(mesh.comm("embedding"), copy, False, timeout_s)

    def _early_weight_params(self) -> list[torch.Tensor]:
        """Zero bubble, last stage: the output projection's weights, whose gradient is
        formed right after I instead of in the deferred W. Deferred, W would need the
        logits' gradient, tokens x vocabulary per waiting microbatch (the last stage
        of ZB-H1 keeps up to p - 1 waiting: for llama3-8b at p = 8, sequence 8192, 7 x
        2.1 GB in bf16); formed early, the stage keeps one sum of the step's head
        gradients instead (one weight's size), which its final W adds to .grad. The
        matmul runs once the input gradient is on its way upstream (`_transfer`), so
        it does not delay the stage before."""
        last = self.layout.last_stage
        if not any(s == last for s, _ in self._train_run(self.microbatches).deferred):
            return []
        if self.tied is not None:
            return [self.tied.weight]
        return [p for name in self.plan.head if self.plan.role_of(name) == VOCAB_HEAD
                for p in self.module.get_submodule(name).parameters() if p.requires_grad]

    def schedule(self, microbatches: int) -> Schedule:
        """The validated schedule for `microbatches` (built once per count)."""
        if microbatches not in self._schedules:
            self._schedules[microbatches] = validated_schedule(
                self.schedule_name, self.layout.n_ranks, microbatches, self.virtual)
        return self._schedules[microbatches]

    def _rank_run(self, sched: Schedule) -> _RankRun:
        actions = sched.ranks[self.rank]
        return _RankRun(actions, final_backwards(actions), deferred_weight_passes(actions),
                        split_backwards(actions), delivery_proofs(sched, self.rank),
                        self._early_receives(actions) if self.transport.early_receives
                        else None)

    def _train_run(self, microbatches: int) -> _RankRun:
        if microbatches not in self._train_runs:
            self._train_runs[microbatches] = self._rank_run(self.schedule(microbatches))
        return self._train_runs[microbatches]

    # The two entry points ------------------------------------------------------------
    def train(self, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
              segments: torch.Tensor | None = None,
              targets_per_rank: float | None = None) -> float:
        check_microbatches(inputs.shape[0], microbatches)
        run = self._train_run(microbatches)
        step = _Step(list(inputs.chunk(microbatches)), list(targets.chunk(microbatches)),
                     microbatches, train=True, deferred=run.deferred, split=run.split,
                     segments=_chunks(segments, microbatches),
                     targets_per_rank=targets_per_rank)
        self._run(run, step)
        return float(sum(loss.item() for loss in step.losses))

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 segments: torch.Tensor | None = None,
                 targets_per_rank: float | None = None) -> float:
        m = self.microbatches if inputs.shape[0] % self.microbatches == 0 else 1
        if m not in self._eval_runs:
            # Its own proofs: interleaved sends forwards back to rank 0 too.
            self._eval_runs[m] = self._rank_run(forward_only(self.schedule(m)))
        step = _Step(list(inputs.chunk(m)), list(targets.chunk(m)), m, train=False,
                     segments=_chunks(segments, m), targets_per_rank=targets_per_rank)
        training_timeline = self.timeline  # `timeline` shows the last *training* step
        self._run(self._eval_runs[m], step)
        self.timeline = training_timeline
        return float(sum(loss.item() for loss in step.losses))

    # Execution -----------------------------------------------------------------------
    def save_timeline(self, path, title: str = ""):
        """Draw the last training step as measured (collective over the pipeline
        group; global rank 0 writes the PNG and gets its path)."""
        from partita.pipeline.measure import save_timeline

        return save_timeline(self, path, title)

    def _run(self, run: _RankRun, step: _Step) -> None:
        self.timeline = []
        if step.train:
            self.held_peak = {}
            self.deferred_bytes = 0  # a step cut short must not leave a count behind
        if self.tied is not None:
            self.tied.begin(want_grad=step.train)
        actions, final, plan = run.actions, run.final, run.early
        self.transport.proofs = run.proofs
        self.step_started = t0 = time.perf_counter()
        early: dict[Action, tuple[object, torch.Tensor, float]] = {}
        timeline = self.timeline
        clock = time.perf_counter
        i = 0
        n = len(actions)
        while i < n:
            a = actions[i]
            if a.kind.is_compute:
                if plan is not None and plan[i]:
                    self._post_early(plan[i], step, early, t0)
                start = clock() - t0
                self._compute(a, step, final)
                timeline.append((a, start, clock() - t0))
                self.transport.release_sent()
                i += 1
                continue
            j = i
            while j < n and not actions[j].kind.is_compute:
                j += 1
            self._transfer(actions[i:j], step, early, t0)
            i = j
        self.transport.finish()
        if self.tied is not None:
            self.tied.finish()

    def _recv_buffer(self, step: _Step) -> torch.Tensor:
        return torch.empty(self._boundary_shape(step), dtype=self.dtype, device=self.device)

    def _early_receives(self, actions: tuple[Action, ...]) -> list[tuple[Action, ...]]:
        """Per action index, the receives to post just before that compute (gloo only,
        see Transport): those listed up to the p-th compute ahead and not posted yet, so
        the data moves while we compute; the window bounds the extra receive buffers to
        about p. Worked out once per `_RankRun`, not on every compute."""
        posted: set[Action] = set()
        plan: list[tuple[Action, ...]] = []
        for i, a in enumerate(actions):
            if not a.kind.is_compute:
                if a.kind.is_recv:
                    posted.add(a)  # posted by _transfer when reached, if not before
                plan.append(())
                continue
            batch, computes, j = [], 0, i + 1
            while j < len(actions) and computes < self.layout.n_ranks:
                b = actions[j]
                if b.kind.is_compute:
                    computes += 1
                elif b.kind.is_recv and b not in posted:
                    batch.append(b)
                    posted.add(b)
                j += 1
            plan.append(tuple(batch))
        return plan

    def _post_early(self, batch: tuple[Action, ...], step: _Step, early: dict,
                    t0: float) -> None:
        """Post receives ahead of the computes in front of them (see `_early_receives`),
        from the transport's helper thread."""
        start = time.perf_counter() - t0
        posted = [(a, self._recv_buffer(step)) for a in batch]
        for (a, buf), work in zip(posted, self.transport.post_recvs(posted)):
            early[a] = (work, buf, start)

    def _transfer(self, batch: tuple[Action, ...], step: _Step, early: dict,
                  t0: float) -> None:
        posted = []
        for a in batch:
            if a.kind.is_send:
                posted.append((a, step.outbox.pop(a)))
            elif a not in early:
                posted.append((a, self._recv_buffer(step)))
        start = time.perf_counter() - t0
        works = dict(self.transport.post(posted))
        if step.early:  # the sends are on their way: compute while receives arrive
            self._run_early(step, t0)
        buffers = {a: t for a, t in posted if a.kind.is_recv}
        for a in batch:
            if a.kind.is_send:
                self.timeline.append((a, start, start))
                continue
            work, buf, posted_at = early.pop(a) if a in early else (works[a], buffers[a], start)
            self.transport.wait(a, work)
            self.transport.received(a)
            step.inbox[a.transfer_key] = buf
            self.timeline.append((a, max(posted_at, start), time.perf_counter() - t0))

    def _run_early(self, step: _Step, t0: float) -> None:
        """The output projection's weight passes recorded by I (`_early_weight_params`),
        summed into the step's head gradients."""
        for a, weights in step.early:
            start = time.perf_counter() - t0
            for param, grad in weights.gradients():
                held = step.early_grads.get(id(param))
                if held is None:
                    step.early_grads[id(param)] = (param, grad)
                    self.deferred_bytes += grad.numel() * grad.element_size()
                else:
                    held[1].add_(grad)
            self.timeline.append((a, start, time.perf_counter() - t0))
        step.early.clear()

    def _apply_early(self, step: _Step) -> None:
        """Final W of the last stage: the summed head gradients join .grad (inside the
        engine's grad_sync, as every other gradient of that W)."""
        if step.early_grads:
            params = [p for p, _ in step.early_grads.values()]
            torch.autograd.backward(params, [g for _, g in step.early_grads.values()],
                                    inputs=params)
            self.deferred_bytes -= sum(g.numel() * g.element_size()
                                       for _, g in step.early_grads.values())
            step.early_grads.clear()

    def _boundary_shape(self, step: _Step) -> tuple[int, int, int]:
        b = step.inputs[0].shape[0]
        return (b, self.seq_len // self.seq_divisor, self.dim)

    def _compute(self, a: Action, step: _Step, final: dict[int, Action]) -> None:
        if a.kind is Kind.F:
            self._forward(a, step)
        elif a.kind is Kind.I:
            self._backward_input(a, step)
        else:
            self._backward(a, step, a == final.get(a.stage))

    def _take(self, step: _Step, direction: str, stage: int, mb: int) -> torch.Tensor:
        """A tensor from the peer (received) or from this rank's own neighbouring stage."""
        found = step.inbox.pop((direction, stage, mb), None)
        if found is None:
            kind = Kind.SEND_F if direction == "F" else Kind.SEND_B
            found = step.outbox.pop(Action(kind, stage, mb))
        return found

    def _forward(self, a: Action, step: _Step) -> None:
        stage, mb = self.stages[a.stage], a.microbatch
        p = _Pass()
        with torch.set_grad_enabled(step.train):
            if stage.first:
                embedded = st.embed(self.module, step.inputs[mb].to(self.device))
                if self.tied is not None:
                    self.tied.send_weight()
                if (a.stage, mb) in step.split:
                    # Detached so the embedding's backward can run apart from the
                    # blocks' (in W; the tied head's gradient joins it there).
                    p.x = embedded.detach().requires_grad_(step.train)
                    p.embedded = embedded
                else:  # B: one backward through the blocks and the embedding
                    p.x = embedded
            else:
                p.x = self._take(step, "F", a.stage - 1, mb).detach().requires_grad_(step.train)
            # Only the graph from p.x on: I releases what W cannot read (the embedding's
            # backward, stage 0's W, reads its own saved tensors).
            p.saves = ForwardSaves() if (a.stage, mb) in step.deferred else None
            with p.saves or contextlib.nullcontext():
                segments = None if step.segments is None else step.segments[mb].to(self.device)
                out = st.run_blocks(self.module, self.plan, stage, p.x, segments)
                if stage.last:
                    if self.tied is not None:
                        self.tied.wait_weight()
                    logits = st.head(self.module, out)
                    # Mean over this microbatch's tokens / number of microbatches: the
                    # sum over microbatches is the mean over the rank's batch.
                    y = step.targets[mb]
                    loss = self.loss_fn(logits, y.to(self.device)) / step.m
                    loss = loss * microbatch_weight(y, step.m, step.targets_per_rank)
                    step.losses.append(loss.detach())
                    scale = self.dp.loss_scale
                    p.root = loss * scale if scale != 1 else loss
                else:
                    # Detached: the send keeps the data until the peer has it (gloo:
                    # until the step's end), not the graph; backward goes via `edge`.
                    step.outbox[Action(Kind.SEND_F, a.stage, mb)] = out.detach()
                    p.edge = as_edge(out) if step.train else None
        if step.train:
            step.passes[(a.stage, mb)] = p
            held = step.held[a.stage] = step.held.get(a.stage, 0) + 1
            if held > self.held_peak.get(a.stage, 0):
                self.held_peak[a.stage] = held

    def _output_grad(self, a: Action, step: _Step, p: _Pass) -> tuple[list, list]:
        if p.root is not None:
            return [p.root], [torch.ones_like(p.root)]
        return [p.edge], [self._take(step, "B", a.stage + 1, a.microbatch)]

    def _backward(self, a: Action, step: _Step, is_final: bool) -> None:
        """B (whole backward) or W (weight half after I) of (stage, microbatch)."""
        stage = self.stages[a.stage]
        if a.kind is Kind.B:
            p = step.passes[(a.stage, a.microbatch)]
        else:
            p = step.passes.pop((a.stage, a.microbatch))
            step.held[a.stage] -= 1
            self.deferred_bytes -= p.deferred_bytes
            if step.early:  # not run after a transfer yet (none came since its I)
                self._run_early(step, self.step_started)
        with self.dp.grad_sync(is_final, self.stage_buckets.get(a.stage)):
            if a.kind is Kind.B:
                roots, grads = self._output_grad(a, step, p)
                if stage.first:  # p.x is the embedding's output: this reaches it too
                    self._tied_root(roots, grads, is_final)
                full_backward(roots, grads)
                x_grad = None if stage.first else p.x.grad
            else:
                p.weights.run()
                if is_final and stage.last:
                    self._apply_early(step)
                if stage.first:
                    roots, grads = [p.embedded], [p.x_grad]
                    self._tied_root(roots, grads, is_final)
                    full_backward(roots, grads)
        if a.kind is Kind.B:
            step.passes.pop((a.stage, a.microbatch))
            step.held[a.stage] -= 1
            if not stage.first:
                step.outbox[Action(Kind.SEND_B, a.stage, a.microbatch)] = x_grad
        if stage.last and is_final and self.tied is not None:
            self.tied.send_grad()

    def _tied_root(self, roots: list, grads: list, is_final: bool) -> None:
        """Stage 0's last backward of the step also carries the tied head's gradient
        from the last stage, so both accumulate into the embedding weight at once."""
        if is_final and self.tied is not None:
            weight, head_grad = self.tied.extra_root()
            roots.append(weight)
            grads.append(head_grad)

    def _backward_input(self, a: Action, step: _Step) -> None:
        stage = self.stages[a.stage]
        p = step.passes[(a.stage, a.microbatch)]
        roots, grads = self._output_grad(a, step, p)
        params = [t for t in self.module.parameters() if t.requires_grad]
        if self.tied is not None and not self.tied.owner:
            params.append(self.tied.weight)
        (x_grad,), p.weights = backward_input(roots, grads, [p.x], params, p.saves)
        p.root = p.edge = p.saves = p.x = None  # W reads none of them
        if stage.last and self.early_params:
            # Timed as a second piece of this I (it runs in I's turn, after the send).
            step.early.append((a, p.weights.take(self.early_params)))
        if stage.first:
            p.x_grad = x_grad
        else:
            step.outbox[Action(Kind.SEND_B, a.stage, a.microbatch)] = x_grad
        self.deferred_bytes += p.deferred_bytes
