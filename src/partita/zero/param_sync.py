"""Stages 1 and 2: the all-gather of updated parameters overlaps the next forward.

After the optimizer step each bucket's all-gather is launched in forward order (the
reverse of the gradient-bucket order) and not waited for. A forward pre-hook on every
module that owns parameters waits for the gathers of its own buckets only, so the first
layers compute while the last layers' parameters are still arriving. Anything else that
reads parameters (the next optimizer step, gathered_parameters, owned_slices) calls
`wait_all()` first.

Under host offload the update itself runs in the background (`HostOptimizer.start_step`)
and the buckets are queued instead (`queue`): the first wait for a queued bucket waits
for its update and launches its gather, after those of the buckets queued before it, so
every rank still issues the same gathers in the same order, whatever the timing. At
stage 0 (nothing to gather, `gathers=False`) the same hooks only wait for the updates.

Limitation, stated (stages 1-2, and stage 0 under host offload): a parameter must
first be used in the forward of the module that owns it (or of a module that runs after it). A model that uses module A's weight inside
module B before A has run must call `dp.wait_params()` in B.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from partita.comm import GroupComm
from partita.zero.flat import FlatBuffer


class ParamAllGather:
    def __init__(self, module: nn.Module, buckets: list[FlatBuffer], comm: GroupComm,
                 gathers: bool = True, ready: Callable[[int], None] | None = None) -> None:
        self.buckets, self.comm, self.module = buckets, comm, module
        self.gathers, self.ready = gathers, ready  # ready(b): b's update is in
        self.pending: dict[int, object] = {}
        self.queued: list[int] = []  # updated in the background, gathered on first wait
        self.where = {id(p): b for b, buf in enumerate(buckets) for p in buf.params}
        self.handles: list = []
        self.regroup([])

    def regroup(self, units: list[nn.Module]) -> None:
        """Wait once at each of `units` for every parameter inside it, instead of at each
        module inside: a compiled unit would run those inner hooks in its compiled code,
        where a wait breaks the graph. Modules outside the units keep their own waits."""
        for handle in self.handles:
            handle.remove()
        inside = {id(m) for u in units for m in u.modules()}
        owners = [(u, u.parameters()) for u in units]
        owners += [(m, m.parameters(recurse=False)) for m in self.module.modules()
                   if id(m) not in inside]
        self.handles = []
        for m, params in owners:
            mine = sorted({self.where[id(p)] for p in params if id(p) in self.where})
            if mine:
                self.handles.append(m.register_forward_pre_hook(self._waiter(mine)))

    def _waiter(self, mine: list[int]):
        def hook(module, args) -> None:
            if self.pending or self.queued:
                for b in mine:
                    self.wait(b)
        return hook

    def launch(self, b: int) -> None:
        buf = self.buckets[b]
        self.pending[b] = (buf.comm or self.comm).all_gather_flat(buf.full, buf.full[buf.lo:buf.hi],
                                                    async_op=True)

    def queue(self, order: list[int]) -> None:
        """The buckets of `order` are being updated in the background, in that order."""
        self.queued = list(order)

    def _release(self, b: int) -> None:
        """Launch the queued gathers up to `b`, in queue order, each after its update."""
        while b in self.queued:
            q = self.queued.pop(0)
            if self.ready is not None:
                self.ready(q)
            if self.gathers:
                self.launch(q)

    def wait(self, b: int) -> None:
        self._release(b)
        work = self.pending.pop(b, None)
        if work is not None:
            work.wait()

    def wait_all(self) -> None:
        if self.queued:
            self._release(self.queued[-1])
        # In launch order, which is the order every rank issued them.
        for b in list(self.pending):
            self.wait(b)
