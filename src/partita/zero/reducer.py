"""Gradient reduction: each bucket's collective starts as soon as its gradients are in.

A hook on each parameter (`register_post_accumulate_grad_hook`; not on those of the
last bucket in stages 0-1, see below) counts arrivals per bucket during backward. When
a bucket is complete its collective is launched asynchronously (gloo and NCCL run it on
their own threads/streams) while backward goes on with earlier layers. Buckets launch
strictly in bucket order, so every rank issues the same collectives in the same
sequence whatever its timing.

Per stage:
  0  all-reduce the full gradient buffer (params' .grad are views into it);
  1  reduce-scatter the full buffer in place; the owned slice holds the result;
  2  reduce-scatter into the owned gradient slice, then free the full-size buffer
     ("reduce" accumulation: every microbatch; "buffer": once, at the boundary);
  3  as 2, and the bucket is a block whose gathered parameters are freed right after.

Stages 0 and 1 keep their full gradient buffers for the whole run and bind .grad to
views of them (DDP's gradient_as_bucket_view); the bucket is divided by the group size
in one op just before its collective. zero_grad() sets every .grad to None, as torch's
does: a step's first gradient of a parameter is then autograd's own tensor, copied
into its view when seen (`_fold`: by the hook, or at launch), and later microbatches
accumulate into the view in place. Clearing the buckets instead and letting autograd
add into the zeros costs a memset and one more read of every gradient element per
step (the memset alone: 10-14 ms for a 20M-parameter model on one CPU thread, a
third of its fused AdamW step). A .grad that user code replaced or dropped is folded
back into the bucket the same way. The bucket launched last has no hooks there: it holds the first layers,
whose gradients are the last of the backward, so a hook could launch it hardly earlier
than the end of the round (`end_round`, or finish_grad_sync after a backward outside
grad_sync) does, and Python hooks are not free: the tiny model's one bucket at 2
ranks, 39 hooks, cost 0.6-1.7 ms of a 37 ms backward (a step without them: 0.98-0.99
of one with them). With a group of one rank (pure tensor or pipeline parallelism, one
process) nothing is communicated and no hook is registered at all.

Stages 0-1 with a reduce dtype wider than the parameters' (bf16 parameters, fp32
reductions: `MixedPrecision.grad_dtype`) hold their buckets in that dtype. A .grad can
only have its parameter's dtype, so there nothing is bound: the hooks add each gradient
into the bucket (as in stages 2-3) and .grad stays None. Microbatches then accumulate,
and clipping and the update read, at the reduction's precision; the cost is 2 more
bytes per parameter than bf16 buckets.

A round that reduces (the last microbatch's, or every one in stages 2-3 "reduce")
reduces every bucket at its end, complete or not: a parameter that got no gradient
(unused this step, on every rank alike) leaves its bucket incomplete, and it is
launched by `flush` with that parameter's gradient zero.

`on_reduced(b, final)`, when given (host offload), is called as each bucket's reduced
result lands in its owned gradient, `final` when no later round of the step adds to
it; a bucket in flight is completed as soon as its collective is (polled whenever
another bucket launches), so the callback runs during backward for all but the
buckets reduced last. With it, a group of one rank keeps its hooks, so that buckets
complete one by one during backward there too.

Stages 2 and 3 copy each gradient into a transient bucket already divided by the group
size (one fused pass, as DDP does) and release autograd's own .grad right after. Both
ways, the reduced bucket is the gradient of the mean over all ranks' losses (each rank's
loss being the mean over its own tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from partita.comm import GroupComm
from partita.errors import PartitaError
from partita.zero.flat import FlatBuffer
from partita.zero.policies import ZeroStage


class GradReducer:
    def __init__(self, buckets: list[FlatBuffer], comm: GroupComm, stage: ZeroStage,
                 reduce_dtype: torch.dtype, accumulate_in_full_buffer: bool,
                 on_bucket_done: Callable[[FlatBuffer], None] | None = None,
                 on_reduced: Callable[[int, bool], None] | None = None) -> None:
        self.buckets, self.comm, self.stage = buckets, comm, stage
        self.reduce_dtype = reduce_dtype
        # View mode: microbatches accumulate in the bucket's full buffer, which lives
        # until the boundary (stages 0, 1, and 2 with "buffer":
        # ZeroConfig.accumulates_in_full_buffer); stages 0-1 also bind .grad to it
        # (`bound`, below).
        self.view_mode = accumulate_in_full_buffer
        # Stages 2 ("reduce") and 3 communicate on every microbatch, sync or not.
        self.always_reduce = not self.view_mode
        self.on_bucket_done = on_bucket_done
        self.on_reduced = on_reduced
        self.sync = True
        self.scale = 1.0 / comm.size
        self.written: list[set[int]] = [set() for _ in buckets]
        self.pending: list[tuple[int, object, torch.Tensor, torch.Tensor, bool]] = []
        self.live_bytes = 0
        self.peak_bytes = 0  # communication / staging buffers, high-water mark
        self._reset()
        # See the module docstring: .grad bound to the buckets (stages 0-1, unless they
        # hold gradients in a wider dtype than the parameters'), and no hooks at all when
        # there is nobody to communicate with.
        self.bound = not stage.shards_gradients and all(
            b.full_grad.dtype == b.dtype for b in buckets)
        # Stages 0-1 keep their buckets from step to step, so the division by the group
        # size waits for the launch, where it covers whatever the bucket holds (at stage
        # 0 a step without zero_grad adds to reduced gradients, as torch's .grad does).
        self.scale_at_launch = not stage.shards_gradients
        self.hookless = self.bound and comm.size == 1 and on_reduced is None
        # Bound mode: the buffers hold gradients reduced since the optimizer last used
        # them, so a second finish_grad_sync (step() calls it again) reduces nothing.
        self.reduced = False
        if self.bound:
            for buf in buckets:
                buf.bind_grads()
        # Bound mode: no hooks on the bucket launched last (module docstring).
        last = len(buckets) - 1
        self.hooked = [not self.hookless and not (self.bound and b == last)
                       for b in range(len(buckets))]
        self.handles = [
            p.register_post_accumulate_grad_hook(self._hook(b, i))
            for b, buf in enumerate(buckets) if self.hooked[b]
            for i, p in enumerate(buf.params)
        ]

    def note_backward(self) -> None:
        """DataParallel.backward is about to run. Bound mode has no hooks on its last
        bucket to notice a second backward in a round that already synchronised (and
        none at all on one rank); say so here, as hooks on a bucket already in flight
        would, so that code right for one model and group is right for every one."""
        if self.bound:
            if self.sync and self.backwards_in_round:
                _late_gradient("a second backward")
            self.backwards_in_round += 1

    @property
    def _reduces(self) -> bool:
        """This round's gradients are reduced (the last microbatch's, or every one)."""
        return self.sync or self.always_reduce

    def _due(self) -> None:
        """A backward ran in this round (a hook saw a gradient, or grad_sync's body
        ended): if the round reduces, all its buckets are due at its end, hooked or not,
        complete or not. (A bound-mode boundary reduces even unseen: `finish`.)"""
        if self._reduces:
            self.active = True

    def end_round(self) -> None:
        """`grad_sync`'s body (one microbatch's backward) is over: launch what of a
        reducing round is still due, the bucket without hooks among it, so it need not
        wait for finish_grad_sync (a pipeline rank still sends before that)."""
        self._due()
        self.flush()

    def _reset(self) -> None:
        """A new step (or, for stages 2-3 "reduce", a new round): nothing launched."""
        self.launched = [False] * len(self.buckets)
        self.scoped_sync = False  # a chunk's last backward reduced its buckets this step
        self._new_round(None)

    def _new_round(self, scope: tuple[int, ...] | None) -> None:
        self.backwards_in_round = 0
        n = len(self.buckets)
        self.arrived = [set() for _ in range(n)]
        self.ready = [False] * n
        # The buckets this round may launch, in the order it launches them (bucket
        # order), so every rank issues the same collectives in the same sequence.
        self.order = [b for b in (range(n) if scope is None else scope)
                      if not self.launched[b]]
        self.cursor = 0
        self.active = False  # some bucket of this round is due for reduction

    def _hook(self, b: int, i: int):
        return lambda p: self._on_grad(b, i, p)

    # Backward-time ---------------------------------------------------------------------
    def _on_grad(self, b: int, i: int, p: torch.nn.Parameter) -> None:
        if torch.is_grad_enabled():  # backward(create_graph=True): buckets stay out of
            with torch.no_grad():    # the graph (checked, not decorated: ~14 us a call)
                return self._on_grad(b, i, p)
        buf = self.buckets[b]
        if self.launched[b]:
            _late_gradient(f"a gradient for '{buf.entries[i].name}'")
        if self.bound:
            self._fold(p, buf.grad_view(i))
        else:
            self._copy_in(b, i, p)
        self.arrived[b].add(i)
        self._due()  # at the round's end even if no bucket completes
        if len(self.arrived[b]) == len(buf.params):
            if self.on_bucket_done is not None:
                self.on_bucket_done(buf)
            if self._reduces:
                self.ready[b] = True
                self._launch_ready()

    def _copy_in(self, b: int, i: int, p: torch.nn.Parameter) -> None:
        buf = self.buckets[b]
        grad, p.grad = p.grad, None
        if buf.full_grad is None:
            self._allocate(buf, b)
        view = buf.grad_view(i)
        # One fused pass, as DDP does: copy (or add) the gradient into the bucket already
        # divided by the group size, so nothing is left to do after the collective
        # (stages 0-1 divide at the launch instead: `scale_at_launch`).
        scale = 1.0 if self.scale_at_launch else self.scale
        if i in self.written[b]:
            view.add_(grad, alpha=scale)
        else:
            torch.mul(grad, scale, out=view)
            self.written[b].add(i)

    def _fold(self, p: torch.nn.Parameter, view: torch.Tensor) -> None:
        """Bound mode: if user code replaced or dropped this .grad, what .grad holds now
        is the gradient (None: nothing), and the bucket view takes it over."""
        if p.grad is view:
            return
        if p.grad is None:
            if not p.requires_grad:
                self._frozen_after_wrapping(p)
            view.zero_()
        else:
            view.copy_(p.grad)
        p.grad = view

    def _allocate(self, buf: FlatBuffer, b: int) -> None:
        """A transient gradient buffer (stages 2-3); only its padding needs zeros."""
        dtype = buf.dtype if self.view_mode else self.reduce_dtype
        buf.full_grad = torch.empty(buf.padded, dtype=dtype, device=buf.device)
        buf.full_grad[buf.numel:].zero_()
        self.written[b] = set()
        self._track(buf.full_grad)

    def _track(self, t: torch.Tensor | int) -> None:
        self.live_bytes += t if isinstance(t, int) else t.numel() * t.element_size()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _launch_ready(self) -> None:
        while self.cursor < len(self.order) and self.ready[self.order[self.cursor]]:
            self._launch(self.order[self.cursor])
            self.cursor += 1
        if self.on_reduced is not None:
            self._poll()

    def _poll(self) -> None:
        """Complete, in launch order, the buckets whose collectives are done."""
        while self.pending and self.pending[0][1].is_completed():
            self._complete(*self.pending.pop(0))

    def _zero_unwritten(self, b: int) -> None:
        """Parameters that got no gradient since the buffer was last cleared hold zeros."""
        buf = self.buckets[b]
        if buf.full_grad is None:
            self._allocate(buf, b)
        for i in range(len(buf.params)):
            if i not in self.written[b]:
                if not buf.params[i].requires_grad:
                    self._frozen_after_wrapping(buf.params[i])
                buf.grad_view(i).zero_()
                self.written[b].add(i)

    def _launch(self, b: int) -> None:
        buf = self.buckets[b]
        if self.bound:
            if not self.hooked[b]:  # what a hook would have folded on arrival
                for i, p in enumerate(buf.params):
                    self._fold(p, buf.grad_view(i))
        else:
            self._zero_unwritten(b)
        if self.scale_at_launch and self.scale != 1.0:  # one rank: nothing to divide
            buf.full_grad.mul_(self.scale)
        src = buf.full_grad
        send = src if src.dtype == self.reduce_dtype else src.to(self.reduce_dtype)
        if send is not src:
            self._track(send)
        if self.stage.all_reduces_gradients:
            out = send
            work = (buf.comm or self.comm).all_reduce(send, async_op=True)
        else:
            # Stage 1 reduces in place: the full buffer stays (gradients are not sharded)
            # and its owned slice is the output.
            in_place = not self.stage.shards_gradients and send is src
            out = send[buf.lo:buf.hi] if in_place else send.new_empty(buf.shard_numel)
            if not in_place:
                self._track(out)
            comm = buf.comm or self.comm
            work = comm.reduce_scatter_flat(out, send, async_op=True)
            self._track(comm.reduce_scatter_scratch_bytes(send))
        if not self.view_mode:
            buf.full_grad = None  # the pending entry keeps it alive until the wait
            self.written[b] = set()
        # Final: no later round of this step adds to the owned gradient.
        self.pending.append((b, work, send, out, self.sync))
        self.launched[b] = True

    # Boundary --------------------------------------------------------------------------
    @torch.no_grad()
    def _complete(self, b: int, work, send: torch.Tensor, out: torch.Tensor,
                  final: bool) -> None:
        work.wait()
        buf = self.buckets[b]
        if self.stage.all_reduces_gradients:
            if send is not buf.full_grad:
                buf.full_grad.copy_(send)
        elif not self.stage.shards_gradients:  # the owned slice of the full buffer
            if out.data_ptr() != buf.full_grad[buf.lo:].data_ptr():
                buf.full_grad[buf.lo:buf.hi].copy_(out)
        else:
            buf.shard_grad.add_(out)
            if self.view_mode:  # stage 2 "buffer": the full buffer lives until here
                buf.full_grad = None
                self.written[b] = set()
        if self.on_reduced is not None:
            self.on_reduced(b, final)

    def flush(self) -> None:
        """Launch every bucket not yet launched in a round that reduces (unused
        parameters leave buckets incomplete; every rank has the same ones)."""
        if self.active:
            for b in self.order[self.cursor:]:
                self.ready[b] = True
            self._launch_ready()

    def wait_all(self) -> None:
        for entry in self.pending:
            self._complete(*entry)
        self.pending.clear()
        # What stays alive: only stage 2 "buffer" accumulation buffers between microbatches.
        self.live_bytes = sum(b.full_grad.numel() * b.full_grad.element_size()
                              for b in self.buckets
                              if self.stage.shards_gradients and b.full_grad is not None)

    def begin_round(self, sync: bool, scope: tuple[int, ...] | None = None) -> None:
        """A new microbatch's backward is about to run. `scope`: it reaches only these
        buckets' parameters (one pipeline chunk); with sync, for the last time this step.
        In stages 0-1 (and 2 "buffer") the buckets an earlier scoped round launched stay
        in flight: no later backward of the step writes to them (a gradient that does
        is refused as late)."""
        self.flush()
        if scope is None or self.always_reduce:
            self.wait_all()
            self.launched = [False] * len(self.buckets)  # stages 2-3 "reduce": every round
            if scope is None:
                self.scoped_sync = False
        self._new_round(scope)
        self.sync = sync
        if sync and scope is not None:
            self.scoped_sync = True

    def finish(self) -> None:
        if not self.hookless:
            if self.bound and self.sync and not self.reduced:
                # A plain loss.backward() marks nothing due where no hook saw it (the
                # hook-free bucket): the boundary's gradients are reduced all the same.
                self.active = True
            if self.scoped_sync:  # buckets no single chunk covers are reduced now
                self._new_round(None)
                if self.always_reduce:  # only those holding gradients not yet reduced
                    self.order = [b for b in self.order
                                  if self.buckets[b].full_grad is not None]
                self.active = True
            self.flush()
            self.wait_all()
        self._reset()
        self.sync = True
        if self.bound:
            self.reduced = True
            self._rebind()

    def used(self) -> None:
        """The optimizer consumed the reduced gradients: the next boundary reduces."""
        self.reduced = False

    def _frozen_after_wrapping(self, p: torch.nn.Parameter) -> None:
        """A bucket's parameter got no gradient and no longer requires one. Buckets hold
        only parameters trainable when the engine was built, and every parameter without
        a gradient passes here each step, so the check costs training nothing."""
        name = next(buf.entries[i].name for buf in self.buckets
                    for i, q in enumerate(buf.params) if q is p)
        raise _frozen_error(name)

    @torch.no_grad()
    def _rebind(self) -> None:
        """Bound mode, at the boundary: fold back any .grad user code replaced."""
        for buf in self.buckets:
            for i, p in enumerate(buf.params):
                self._fold(p, buf.grad_view(i))

    def clear(self) -> None:
        """zero_grad: forget what the buffers hold; the next gradient overwrites it (in
        bound mode by `_fold`'s copy, see the module docstring)."""
        self.reduced = False
        self.written = [set() for _ in self.buckets]
        for buf in self.buckets:
            for p in buf.params:
                p.grad = None


def _frozen_error(name: str) -> PartitaError:
    return PartitaError(
        f"parameter '{name}' was frozen (requires_grad=False) after DataParallel wrapped "
        "the model: it still sits in the engine's flat buffers, where it would get a zero "
        "gradient while AdamW's momentum and weight decay keep moving it. Freeze "
        "parameters before wrapping the model (DataParallel leaves frozen parameters out "
        "of its buffers), or call dp.close() and wrap the model again after changing "
        "which parameters train.")


def _late_gradient(what: str) -> None:
    raise PartitaError(
        f"{what} arrived after the gradients were already reduced in this step. Wrap "
        "each gradient-accumulation microbatch's backward in `with "
        "dp.grad_sync(is_last_microbatch):` and call dp.finish_grad_sync() before the "
        "optimizer step."
    )
