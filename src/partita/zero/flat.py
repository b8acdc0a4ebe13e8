"""The flat-buffer layer every ZeRO stage shares.

A `FlatBuffer` packs the parameters of one group (a bucket, or a block for stage 3)
back to back into one 1-D buffer, padded so that it splits into `world` equal,
`ALIGN`-element-aligned slices. Rank i owns slice i: `[lo, hi)`. Parameters become views
into the full buffer while it exists (stages 0-2 always; stage 3 only while gathered),
so one `all_gather_flat` / `reduce_scatter_flat` moves a whole group.

Each entry remembers what it is (`FlatEntry`): the parameter's module name, its own
ShardInfo (what the local tensor is of the global parameter, e.g. a tensor-parallel row
block), its local shape and where it sits in the buffer. `pieces()` maps any flat range
back to (parameter, flat range within the parameter); checkpoints and the planner read
that, never this class's internals.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from partita.comm import GroupComm
from partita.sharding import ShardInfo, shard_info

# Elements each rank's slice is aligned to: 64 elements is 128 bytes in bf16, enough
# for vectorised kernels and NCCL's preferred alignment.
ALIGN = 64

# init_fn(info, start, stop): elements [start, stop) of the flattened local tensor
# described by `info`, drawn exactly as a full single-device initialisation would.
InitFn = Callable[[ShardInfo, int, int], torch.Tensor]
# (lo, hi, dtype): the flat range the optimizer's master copy covers, and its dtype.
MasterRange = tuple[int, int, torch.dtype]


def _broadcast_first(full: torch.Tensor, replicas: GroupComm) -> None:
    """Every replica starts from the values of the group's first member, as DDP does at
    construction: replicas seeded differently would otherwise never agree (each update
    is the same, so their difference stays forever). Uncounted: this is set-up, not a
    step's traffic (`partita bench zero-comm` counts steps)."""
    if replicas.size > 1:
        import torch.distributed as dist

        dist.broadcast(full, src=replicas.ranks[0], group=replicas.group)


def decays(shape: tuple[int, ...] | torch.Size) -> bool:
    """AdamW weight decay applies to matrices and embeddings only."""
    return len(shape) >= 2


@dataclass(frozen=True)
class FlatEntry:
    name: str  # module-relative parameter name
    info: ShardInfo  # what the local tensor is of the global parameter
    shape: tuple[int, ...]  # local tensor shape
    offset: int  # first element in the flat buffer
    numel: int

    @property
    def decays(self) -> bool:
        return decays(self.shape)


@dataclass(frozen=True)
class Piece:
    """Part of one parameter inside a flat range: param elements [start, stop) sit at
    buffer elements [buf_start, buf_start + stop - start)."""

    entry: FlatEntry
    start: int
    stop: int
    buf_start: int


class FlatBuffer:
    """One group's parameters as a padded flat buffer, sharded `world` ways."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], world: int, index: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        # Parameters AdamW decays (matrices, embeddings) first, norms and biases after,
        # each in the given order: a slice then holds at most two weight-decay ranges,
        # and the update takes each range as one piece. In the model's order a GPT-2
        # block's biases cut its weights into 12 ranges, each four more views per step
        # (gpt2-124m, fp32 on a CPU: 782 operations for clipping and the update, 318 so).
        # Checkpoints record each parameter's place, so either order loads.
        named_params = sorted(named_params, key=lambda item: not decays(item[1].shape))
        self.params = [p for _, p in named_params]
        self.entries: list[FlatEntry] = []
        offset = 0
        for name, p in named_params:
            self.entries.append(FlatEntry(name, shard_info(p, name), tuple(p.shape), offset,
                                          p.numel()))
            offset += p.numel()
        self.numel = offset
        self.padded = math.ceil(max(offset, 1) / (world * ALIGN)) * world * ALIGN
        self.shard_numel = self.padded // world
        self.world, self.index = world, index
        self.lo, self.hi = index * self.shard_numel, (index + 1) * self.shard_numel
        self.dtype, self.device = dtype, device
        self.full: torch.Tensor | None = None  # every element, parameters are views
        self.shard: torch.Tensor | None = None  # stage 3 at rest: only [lo, hi)
        self._full_grad: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] | None = None
        self.shard_grad: torch.Tensor | None = None
        self.precise: torch.Tensor | None = None  # `_precise`, until the master takes it
        # The group this buffer is sharded and reduced over when it is not the engine's
        # dense one (experts: their expert-data-parallel group); None: the engine's.
        self.comm = None

    def __repr__(self) -> str:
        first, last = self.entries[0].name, self.entries[-1].name
        return f"FlatBuffer({first}..{last}, {self.numel} -> {self.padded} elements)"

    # Metadata --------------------------------------------------------------------------
    def pieces(self, lo: int, hi: int) -> list[Piece]:
        out = []
        for e in self.entries:
            a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
            if a < b:
                out.append(Piece(e, a - e.offset, b - e.offset, a))
        return out

    def owned_pieces(self) -> list[Piece]:
        return self.pieces(self.lo, self.hi)

    def decay_ranges(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Ranges, relative to `lo`, of elements in [lo, hi) that get weight decay
        (`FlatEntry.decays`), adjacent ones merged."""
        out: list[tuple[int, int]] = []
        for pc in self.pieces(lo, hi):
            if not pc.entry.decays:
                continue
            a = pc.buf_start - lo
            b = a + pc.stop - pc.start
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out

    def metadata(self) -> dict:
        """Plain data describing the layout and this rank's slice (for checkpoints)."""
        return {
            "padded": self.padded, "world": self.world, "owned": (self.lo, self.hi),
            "entries": [
                {"name": e.name, "global_name": e.info.name,
                 "global_shape": e.info.global_shape, "split_dim": e.info.dim,
                 "split": (e.info.start, e.info.stop), "more": e.info.more, "shape": e.shape,
                 "offset": e.offset, "numel": e.numel}
                for e in self.entries
            ],
        }

    # Storage ---------------------------------------------------------------------------
    def _values(self, p: nn.Parameter, e: FlatEntry, start: int, stop: int,
                init_fn: InitFn | None) -> torch.Tensor:
        if p.is_meta or p.numel() != e.numel:
            if init_fn is None:
                from partita.errors import PartitaError

                raise PartitaError(
                    f"parameter '{e.name}' is on the meta device and no init_fn was given; "
                    "pass DataParallel(..., init_fn=...) (for partita models "
                    "partita.zero.model_init_fn(plan.init)) or build the model on a real device."
                )
            return init_fn(e.info, start, stop)
        return p.detach().reshape(-1)[start:stop]

    def _holds_values(self) -> bool:
        """Some parameter came with values of its own (not meta, not drawn by init_fn)."""
        return any(not p.is_meta and p.numel() == e.numel
                   for p, e in zip(self.params, self.entries))

    def _filled(self, init_fn: InitFn | None) -> torch.Tensor:
        full = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        for p, e in zip(self.params, self.entries):
            full[e.offset:e.offset + e.numel].copy_(self._values(p, e, 0, e.numel, init_fn))
        return full

    def _precise(self, init_fn: InitFn | None, master: MasterRange | None) -> None:
        """Keep elements [lo, hi) of `master` = (lo, hi, dtype) as `init_fn` draws them,
        in that dtype, for the optimizer's master copy (`precise`): a float32 release
        trained in bf16 would otherwise start its master from bf16-rounded values. Only
        where the buffer is narrower and every parameter is drawn by `init_fn` (values a
        module brought are agreed on in the buffer's dtype, `_broadcast_first`)."""
        self.precise = None
        if master is None or init_fn is None or self._holds_values():
            return
        lo, hi, dtype = master
        if dtype.itemsize <= self.dtype.itemsize:
            return
        out = torch.zeros(hi - lo, dtype=dtype, device=self.device)
        for pc in self.pieces(lo, hi):
            start = pc.buf_start - lo
            out[start:start + pc.stop - pc.start].copy_(init_fn(pc.entry.info, pc.start,
                                                                pc.stop))
        self.precise = out

    @torch.no_grad()
    def materialize_full(self, init_fn: InitFn | None, replicas: GroupComm | None = None,
                         master: MasterRange | None = None) -> None:
        """Allocate every element and make the parameters views into it (stages 0-2).
        Values a module brought with it are made those of `replicas`' first member;
        `master`: see `_precise`."""
        self._precise(init_fn, master)
        if self.precise is not None and self.precise.numel() == self.padded:
            full = self.precise.to(self.dtype)  # drawn once (stage 0 owns every element)
        else:
            full = self._filled(init_fn)
        if replicas is not None and self._holds_values():
            _broadcast_first(full, replicas)
        self.full = full
        self._unmeta()
        self.bind()

    @torch.no_grad()
    def materialize_shard(self, init_fn: InitFn | None, replicas: GroupComm | None = None,
                          master: MasterRange | None = None) -> None:
        """Allocate only the owned slice (stage 3 at rest); the full buffer exists with
        an empty storage until a gather (`allocate_full`, then `bind`). Values a module
        brought with it are sliced from `replicas`' first member's; `master`: see
        `_precise`."""
        self._precise(init_fn, master)
        if replicas is not None and replicas.size > 1 and self._holds_values():
            # Every rank holds the whole module already, so one transient full buffer
            # costs no more than the module itself; drawn values stay per slice.
            full = self._filled(init_fn)
            _broadcast_first(full, replicas)
            shard = full[self.lo:self.hi].clone()
            del full
        elif self.precise is not None:  # the owned slice, drawn once
            shard = self.precise.to(self.dtype)
        else:
            shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
            for pc in self.owned_pieces():
                p = self.params[self.entries.index(pc.entry)]
                values = self._values(p, pc.entry, pc.start, pc.stop, init_fn)
                start = pc.buf_start - self.lo
                shard[start:start + pc.stop - pc.start].copy_(values)
        self.shard = shard
        self._unmeta()
        # The full buffer's shape over an empty storage: nothing is allocated until the
        # first gather (`allocate_full`).
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)  # at rest
        self.full = torch.empty(0, dtype=self.dtype, device=self.device)
        self.full.set_(self.full.untyped_storage(), 0, (self.padded,))
        self.free_full()

    def _unmeta(self) -> None:
        """Give meta-device parameters a real (empty) body, keeping their identity
        and attributes, so `.data` can point into our buffers from now on."""
        for p in self.params:
            if p.is_meta:
                body = nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.device),
                                    requires_grad=p.requires_grad)
                torch.utils.swap_tensors(p, body)
                p.__dict__.update(body.__dict__)  # swap_tensors swapped attributes too

    def bind(self) -> None:
        """Point every parameter at its view of the full buffer."""
        for p, e in zip(self.params, self.entries):
            p.data = self.full[e.offset:e.offset + e.numel].view(e.shape)

    # Stage 3: the full buffer's storage comes and goes; the tensor stays. Autograd
    # keeps the views a forward saved (a linear layer saves its weight), so only
    # emptying the storage itself frees the memory after forward, and gathering into
    # the same storage again makes those saved views valid for backward (FSDP does the
    # same). The parameters themselves point at empty tensors while the storage is
    # empty: reading a view of an emptied storage crashes the process, reading an empty
    # tensor does not, and a forward that uses a parameter outside its unit fails there
    # with a shape error.
    @property
    def full_allocated(self) -> bool:
        return self.full is not None and self.full.untyped_storage().nbytes() > 0

    def allocate_full(self) -> None:
        """Give the full buffer its storage back (its contents are undefined)."""
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())

    def free_full(self) -> None:
        self.full.untyped_storage().resize_(0)
        for p in self.params:
            p.data = self._empty

    @property
    def full_grad(self) -> torch.Tensor | None:
        """Every gradient element (padded); None while the stage keeps only a shard."""
        return self._full_grad

    @full_grad.setter
    def full_grad(self, value: torch.Tensor | None) -> None:
        self._full_grad = value
        self._grad_views = None

    def grad_view(self, i: int) -> torch.Tensor:
        # Views are made once per buffer: backward hooks ask for one per gradient.
        if self._grad_views is None:
            g = self._full_grad
            self._grad_views = [g[e.offset:e.offset + e.numel].view(e.shape)
                                for e in self.entries]
        return self._grad_views[i]

    def bind_grads(self) -> None:
        for i, p in enumerate(self.params):
            p.grad = self.grad_view(i)

    def owned_param(self) -> torch.Tensor:
        """The owned slice of the parameters in param dtype (a view, never a copy)."""
        return self.shard if self.shard is not None else self.full[self.lo:self.hi]
