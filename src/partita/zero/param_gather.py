"""ZeRO stage 3: parameters sharded at rest, gathered unit by unit around compute.

A gather unit is one block or several consecutive ones (`units.gather_units`), with one
flat buffer: one all-gather and one reduce-scatter each.
Forward:  the root module's pre-hook gathers the root group (embeddings, final norm,
          head: parameters outside any block) and starts prefetching the first units;
          a block's pre-hook waits for its unit's gather and starts the next
          `prefetch` units'; the unit's last block's post-hook frees it. The root and
          the last `keep` units (1 by default) stay gathered until their gradients
          are in when forward records a graph (backward begins with them), and are
          freed at once otherwise.
Backward: a tiny autograd function on each block's (and the root's) output fires when
          backward reaches it: it gathers that unit again and prefetches the
          `prefetch` units before it. When every parameter of a unit has its gradient
          (the GradReducer calls `done`), the unit is freed and its gradients are
          reduce-scattered.
Which unit is gathered when depends only on the unit order and the hooks' sequence,
never on timing, so every rank issues the same all-gathers in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn as nn

from partita.comm import GroupComm
from partita.zero.flat import FlatBuffer


class _PreBackward(torch.autograd.Function):
    """Identity forward; backward first calls `fire` (gathers the parameters)."""

    @staticmethod
    def forward(ctx, fire, *xs):
        ctx.fire = fire
        return xs if len(xs) > 1 else xs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.fire()
        return (None, *grads)


def _on_backward(out, fire):
    """`out` with its grad-requiring tensors routed through _PreBackward."""
    if isinstance(out, torch.Tensor):
        return _PreBackward.apply(fire, out) if out.requires_grad else out
    if isinstance(out, (tuple, list)):
        idx = [i for i, t in enumerate(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return out
        new = _PreBackward.apply(fire, *(out[i] for i in idx))
        new = new if isinstance(new, tuple) else (new,)
        items = list(out)
        for i, t in zip(idx, new):
            items[i] = t
        return type(out)(items)
    return out


class ParamGatherer:
    """`blocks`: the gather units in forward order, each (its block modules, their flat
    buffer). Every block of a unit makes sure the unit is gathered before its forward and
    routes backward through `fire`; the unit's last block frees it after its forward. So
    a model that runs its blocks in another order, or one block twice, stays correct (it
    only keeps a unit gathered longer)."""

    def __init__(self, module: nn.Module, root: FlatBuffer | None,
                 blocks: list[tuple[tuple[nn.Module, ...], FlatBuffer]], comm: GroupComm,
                 prefetch: int,
                 stage_in: Callable[[FlatBuffer], torch.Tensor] | None = None,
                 keep: int = 1) -> None:
        self.root, self.blocks, self.comm, self.prefetch = root, blocks, comm, prefetch
        # Shards at rest in host memory (offload): the device copy each gather reads,
        # kept until that gather is done.
        self.stage_in = stage_in
        self.staged: dict[int, torch.Tensor] = {}
        self.pending: dict[int, object] = {}
        self.gathered: dict[int, FlatBuffer] = {}
        self.in_backward: set[int] = set()
        self.live_bytes = 0
        self.peak_bytes = 0  # high-water mark of gathered parameters during a step
        self.handles = [module.register_forward_pre_hook(self._root_pre),
                        module.register_forward_hook(self._root_post)]
        # Units owned by a submodule of unit k's blocks (an MoE's experts): a recompute
        # wrapped around the block takes its parameters as inputs before the block runs,
        # so they must be gathered when the block starts.
        inside = {id(sub): j for j, (mods, _) in enumerate(blocks) for sub in mods}
        self.nested = [[inside[id(sub)] for m in mods for sub in m.modules()
                        if id(sub) in inside and inside[id(sub)] != k]
                       for k, (mods, _) in enumerate(blocks)]
        # The last units forward runs (with the units nested in them) are the first that
        # backward needs: the last `keep` stay gathered from their forward into their
        # backward rather than being freed and gathered again (one all-gather saved per
        # unit and microbatch, its memory held meanwhile).
        top = [k for k in range(len(blocks)) if not any(k in ns for ns in self.nested)]
        self.kept = {j for k in top[max(0, len(top) - keep):] for j in (k, *self.nested[k])}
        # A kept unit nested in a block leaves its free-or-keep decision to the unit
        # around it: under full recompute its own forward runs with autograd off (inside
        # the block's recompute function) and cannot tell a training forward from an
        # evaluation one, while the enclosing block's hooks run outside and can.
        self.deferred = {j: k for k in range(len(blocks)) for j in self.nested[k]
                         if j in self.kept}
        for k, (mods, _) in enumerate(blocks):
            for m in mods:
                self.handles.append(m.register_forward_pre_hook(self._block_pre(k)))
                self.handles.append(m.register_forward_hook(self._block_post(k, m is mods[-1])))

    # Gather / free ---------------------------------------------------------------------
    def start(self, buf: FlatBuffer) -> None:
        """Begin gathering `buf` unless it is gathered or on its way."""
        if id(buf) in self.gathered or id(buf) in self.pending:
            return
        buf.allocate_full()
        shard = buf.shard
        if self.stage_in is not None:
            shard = self.staged[id(buf)] = self.stage_in(buf)
        # The collective writes every slot, this rank's own included, from the shard.
        comm = buf.comm or self.comm
        self.pending[id(buf)] = comm.all_gather_flat(buf.full, shard, async_op=True)
        self.live_bytes += buf.full.numel() * buf.full.element_size()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def ensure(self, buf: FlatBuffer) -> None:
        self.start(buf)
        work = self.pending.pop(id(buf), None)
        if work is not None:
            work.wait()
            self.staged.pop(id(buf), None)
            buf.bind()
            self.gathered[id(buf)] = buf

    def free(self, buf: FlatBuffer) -> None:
        work = self.pending.pop(id(buf), None)
        if work is not None:  # never drop memory an in-flight gather writes into
            work.wait()
            self.staged.pop(id(buf), None)
        if buf.full_allocated:
            self.live_bytes -= buf.full.numel() * buf.full.element_size()
            buf.free_full()
        self.gathered.pop(id(buf), None)
        self.in_backward.discard(id(buf))

    def done(self, buf: FlatBuffer) -> None:
        """Every gradient of `buf` has arrived: its backward is over."""
        self.free(buf)

    def free_all(self) -> None:
        for buf in self.all_buffers():
            self.free(buf)

    def all_buffers(self) -> list[FlatBuffer]:
        return ([self.root] if self.root is not None else []) + [b for _, b in self.blocks]

    # Hooks -----------------------------------------------------------------------------
    def _prefetch(self, ks: range) -> None:
        for k in ks:
            if 0 <= k < len(self.blocks):
                self.start(self.blocks[k][1])

    def _root_pre(self, module, args) -> None:
        # Issue the root's gather and the first blocks' before waiting for any of them.
        if self.root is not None:
            self.start(self.root)
        self._prefetch(range(self.prefetch))
        if self.root is not None:
            self.ensure(self.root)

    def _root_post(self, module, args, out):
        if self.root is None:
            return out
        if not torch.is_grad_enabled():
            self.free(self.root)
            return out
        # Backward starts with the head, which is in the root group: keep the root
        # gathered until its gradients are in (as FSDP2 does for its root) instead of
        # freeing it and gathering it again at once (the last unit too, `_block_post`).
        self.in_backward.add(id(self.root))
        self._prefetch_for_backward()
        return _on_backward(out, self._root_backward)

    def _root_backward(self) -> None:
        self.ensure(self.root)
        self.in_backward.add(id(self.root))
        self._prefetch_for_backward()

    def _prefetch_for_backward(self) -> None:
        # Backward needs the last units first, and the kept ones are still gathered:
        # start gathering the `prefetch` units before them now, so that those gathers
        # overlap the loss, the head's backward and the kept units' backward.
        ahead = [k for k in reversed(range(len(self.blocks))) if k not in self.kept]
        for k in ahead[:self.prefetch]:
            self.start(self.blocks[k][1])

    def _block_pre(self, k: int):
        def hook(module, args) -> None:
            buf = self.blocks[k][1]
            if id(buf) in self.in_backward:
                # A recompute inside backward: the unit is gathered already, and the next
                # one's backward is over, so prefetching it would be a wasted gather.
                return
            if torch._C._current_graph_task_id() != -1:
                # A recompute reached a unit inside its block (an MoE's experts) before
                # that unit's own backward: gather it for the backward about to run and
                # keep it until its gradients are in; prefetch nothing (see above).
                self.ensure(buf)
                self.in_backward.add(id(buf))
                return
            self.start(buf)
            self._prefetch(range(k + 1, k + 1 + self.prefetch))
            for j in self.nested[k]:
                self.start(self.blocks[j][1])
            self.ensure(buf)
            for j in self.nested[k]:
                self.ensure(self.blocks[j][1])
        return hook

    def _block_post(self, k: int, frees: bool):
        buf = self.blocks[k][1]

        def fire() -> None:
            self.ensure(buf)
            self.in_backward.add(id(buf))
            self._prefetch(range(k - 1, k - 1 - self.prefetch, -1))

        def hook(module, args, out):
            # A recompute (activation checkpointing) runs forward inside backward: keep
            # the parameters that backward is about to use.
            forward_pass = torch._C._current_graph_task_id() == -1
            if frees and id(buf) not in self.in_backward and not (
                    k in self.deferred and forward_pass):
                keep = k in self.kept and torch.is_grad_enabled() and forward_pass
                for j in [k, *(j for j in self.nested[k] if j in self.deferred)]:
                    b = self.blocks[j][1]
                    if keep:
                        self.in_backward.add(id(b))
                    elif id(b) not in self.in_backward:
                        self.free(b)
            return _on_backward(out, fire) if torch.is_grad_enabled() else out
        return hook

    @contextmanager
    def everything(self):
        """Every group gathered (for reading or writing full parameters)."""
        for buf in self.all_buffers():
            self.start(buf)
        for buf in self.all_buffers():
            self.ensure(buf)
        try:
            yield
        finally:
            self.free_all()
