"""Measuring the activations autograd saves for backward, to check memory formulas.

    meter = SavedTensorMeter(model)
    with meter:
        loss = loss_fn(model(x), y)
    meter.bytes  # what backward will read, until it runs

Every tensor autograd packs for backward passes through a `saved_tensors_hooks` pack
hook. We count each distinct storage once, by its data pointer: one tensor saved by
several operations (a norm's output feeding Q, K and V) and views of one buffer (a
transposed attention output) cost memory once. Storages of parameters are weights, not
activations, and are left out -- including a ZeRO-3 block gathered just for this
forward, which is why the parameter set is read at each pack rather than once. A
parameter-derived copy (a weight clone, rows index-selected from a weight) is a new
storage and is counted: it is memory held for backward like any activation.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn


class SavedTensorMeter:
    """Bytes of distinct non-parameter storages saved for backward inside the context."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.storages: dict[int, tuple[int, torch.dtype]] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _param_storages(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in self.module.parameters()
                if p.numel() > 0}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.storages and storage.nbytes() > 0 and \
                ptr not in self._param_storages():
            self.storages[ptr] = (storage.nbytes(), t.dtype)
        return t

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
        return sum(n for n, _ in self.storages.values())

    def by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for n, dtype in self.storages.values():
            out[str(dtype).removeprefix("torch.")] += n
        return dict(out)
