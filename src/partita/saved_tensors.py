"""Measuring the activations autograd saves for backward, to check memory formulas.

    meter = SavedTensorMeter(model)
    with meter:
        loss = loss_fn(model(x), y)
    meter.bytes  # every storage saved inside the context
    meter.peak_bytes  # the most saved storages alive at once (a pipeline's in-flight peak)

Every tensor autograd packs for backward passes through a `saved_tensors_hooks` pack
hook. We count each distinct storage once, by its data pointer: one tensor saved by
several operations (a norm's output feeding Q, K and V) and views of one buffer (a
transposed attention output) cost memory once. Storages of parameters are weights, not
activations, and are left out -- including a ZeRO-3 block gathered just for this
forward, which is why the parameter set is read at each pack rather than once. A
parameter-derived copy (a weight clone, rows index-selected from a weight) is a new
storage and is counted: it is memory held for backward like any activation.

A storage stays alive while any tensor saved on it does (weak references tell), so
`peak_bytes`, sampled whenever something is saved, is the high-water mark of memory
held for backward even when backwards free earlier microbatches meanwhile. Memory held
for backward outside autograd (a zero-bubble pipeline's gradients recorded for its
deferred weight pass) joins the samples through `held_elsewhere`.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn as nn


class SavedTensorMeter:
    """Bytes of distinct non-parameter storages saved for backward inside the context."""

    def __init__(self, module: nn.Module,
                 held_elsewhere: Callable[[], int] | None = None) -> None:
        self.module = module
        self.held_elsewhere = held_elsewhere
        self.storages: dict[int, tuple[int, torch.dtype]] = {}
        self._refs: dict[int, list[weakref.ref]] = defaultdict(list)
        self.peak_bytes = 0
        self._saved: dict[str, int] = defaultdict(int)  # every storage ever saved, by dtype
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _param_storages(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in self.module.parameters()
                if p.numel() > 0}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        # A new storage, or a new one at the address of a freed one (no tensor saved on
        # the old one is alive any more; a ZeRO-3 gather may reuse it for parameters).
        fresh = ptr not in self.storages or not self._alive(ptr)
        if fresh and (storage.nbytes() == 0 or ptr in self._param_storages()):
            return t
        if fresh:
            self.storages[ptr] = (storage.nbytes(), t.dtype)
            self._refs[ptr].clear()
            self._saved[str(t.dtype).removeprefix("torch.")] += storage.nbytes()
        # Keep and return a detached view: returning `t` itself would make a node that
        # saves its own output hold that output, which holds the node through grad_fn --
        # a cycle the garbage collector cannot see, keeping deferred (zero-bubble) graphs
        # alive after their weight pass.
        t = t.detach()
        self._refs[ptr].append(weakref.ref(t))
        extra = self.held_elsewhere() if self.held_elsewhere is not None else 0
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + extra)
        return t

    def _alive(self, ptr: int) -> bool:
        return any(r() is not None for r in self._refs[ptr])

    @property
    def live_bytes(self) -> int:
        """Bytes of saved storages some saved tensor still holds."""
        return sum(n for ptr, (n, _) in self.storages.items() if self._alive(ptr))

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None

    @property
    def bytes(self) -> int:
        """Every distinct storage saved inside the context, freed since or not."""
        return sum(self._saved.values())

    def by_dtype(self) -> dict[str, int]:
        return dict(self._saved)
