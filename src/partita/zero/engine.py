"""`DataParallel`: data parallelism with ZeRO stages 0-3 over the mesh's zero_shard group.

    dp = DataParallel(model, mesh, zero=ZeroConfig(stage=2), precision=MixedPrecision(...),
                      optim=AdamWConfig(lr=3e-4))  # partita.optim.AdamWConfig
    for i, batch in enumerate(microbatches):
        with dp.grad_sync(i == len(microbatches) - 1):
            dp.backward(loss_fn(dp.module(batch)) / len(microbatches))
    dp.finish_grad_sync()
    dp.clip_grad_norm_(1.0)
    dp.step(lr)
    dp.zero_grad()

Averaging: each rank's loss is the mean over its own tokens; gradients are summed over
the zero_shard group (dp x cp) and divided by its size, which is the gradient of the
global-batch mean when every rank holds as many tokens. Gradient-accumulation microbatches
under `grad_sync(False)` communicate nothing in stages 0 and 1 (and 2 with
accumulation="buffer"); stage 2 "reduce" and stage 3 reduce-scatter every microbatch.

The optimizer math (AdamW, the gradient norm and clip factor) is partita.optim's; this
engine decides which flat slice each rank updates and which elements it counts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from partita.errors import PartitaError
from partita.memory.disk import DiskOptimizer
from partita.memory.offload import HostOptimizer, OffloadPolicy, host_empty, stage_in
from partita.mesh import Mesh
from partita.optim import (
    AdamWConfig,
    AdamWState,
    adamw_scratch,
    clip_coefficient,
    global_norm,
    squared_sum,
)
from partita.zero import ownership
from partita.zero.families import by_family, family_buffer
from partita.zero.flat import FlatBuffer, InitFn, Piece
from partita.zero.gather_layout import stage3_buffers
from partita.zero.ledger import memory_ledger
from partita.zero.materialize import check_nothing_left_on_meta, device_of, flat_init_fn
from partita.zero.owned import (
    OwnedSlice,
    owned_slices,
    owned_slices_loaded,
    start_masters_precisely,
    writes_piece,
)
from partita.zero.param_gather import ParamGatherer
from partita.zero.param_sync import ParamAllGather
from partita.zero.policies import MixedPrecision, ZeroConfig
from partita.zero.reducer import GradReducer
from partita.zero.scaler import LossScaler
from partita.zero.units import (
    BlockSpec,
    buckets_by_size,
    require_blocks,
    require_model_parallel,
    resolve_blocks,
)


class DataParallel:
    def __init__(self, module: nn.Module, mesh: Mesh, zero: ZeroConfig | None = None,
                 precision: MixedPrecision | None = None,
                 optim: AdamWConfig | None = None, blocks: BlockSpec = None,
                 init_fn: InitFn | None = None, device: torch.device | None = None,
                 bucket_key: Callable[[str], object] | None = None,
                 offload: OffloadPolicy | None = None) -> None:
        # Refused before anything touches the parameters, so that a second engine over
        # them leaves the first one intact; given back if construction fails.
        ownership.claim(self, ownership.trainable(module))
        self.left_out = ownership.frozen(module)
        try:
            self._build(module, mesh, zero, precision, optim, blocks, init_fn, device,
                        bucket_key, offload)
        except BaseException:
            ownership.release(self)
            raise

    def _build(self, module: nn.Module, mesh: Mesh, zero: ZeroConfig | None,
               precision: MixedPrecision | None, optim: AdamWConfig | None,
               blocks: BlockSpec, init_fn: InitFn | None, device: torch.device | None,
               bucket_key: Callable[[str], object] | None,
               offload: OffloadPolicy | None) -> None:
        zero, precision = zero or ZeroConfig(), precision or MixedPrecision()
        self.offload = offload = offload or OffloadPolicy()
        if offload.params and not zero.stage.shards_parameters:
            raise PartitaError(
                f"parallel.offload={offload.mode} keeps parameter shards in host memory, "
                f"but ZeRO stage {int(zero.stage)} has no parameter shards; use "
                "parallel.zero_stage=3, or parallel.offload=optimizer.")
        optim = optim or AdamWConfig()
        self.comm = mesh.comm("zero_shard")
        self.mp_comm = mesh.comm("model_parallel")
        # Checked however many ranks share the shards, so that a setting fails alike on one.
        require_model_parallel(module, mesh)
        names: list[str] = []
        if zero.stage.shards_parameters:
            names = resolve_blocks(module, blocks)
            require_blocks(module, names)
        if self.comm.size == 1 and not offload.optimizer:
            # A one-rank group's shard is the whole buffer: sharding would only copy
            # (docs/zero.md), so every stage runs as 0, as the planner counts it there.
            # Offload keeps its stage: it moves the shards elsewhere.
            zero = dataclasses.replace(zero, stage=0)
        self.module, self.mesh, self.zero = module, mesh, zero
        self.precision, self.optim = precision, optim
        self.stage = zero.stage  # a ZeroStage: read its properties, not its number
        device = self.device = device or device_of(module)
        dtype = precision.param_dtype
        init_fn = flat_init_fn(init_fn)
        self.gatherer: ParamGatherer | None = None
        if self.stage.shards_parameters:
            root, block_bufs = stage3_buffers(module, names, mesh, self.comm,
                                              zero.bucket_bytes, dtype, device)
            # Reduction order = the order backward completes them: last block first, root
            # (embeddings are the last gradients of all) at the end.
            self.buckets = [b for _, b in reversed(block_bufs)] + ([root] if root else [])
            for buf in self.buckets:
                buf.materialize_shard(init_fn, buf.comm or self.comm,
                                      (*self._owned_range(buf), precision.master))
            if offload.params and not offload.disk:
                for buf in self.buckets:  # at rest on the host; copied in per gather
                    buf.shard = host_empty(buf.shard_numel, dtype, device).copy_(buf.shard)
            # Under host offload every gather first waits for its bucket's update
            # (`_stage_in`), which runs in the background after step().
            staged = offload.params or (offload.optimizer and not offload.disk)
            self.gatherer = ParamGatherer(module, root, block_bufs, self.comm, zero.prefetch,
                                          self._stage_in if staged else None,
                                          keep=zero.keep_gathered)
        else:
            # A small first and last bucket buy overlap where collectives run beside the
            # backward (NCCL on its own streams). On CPU the reduction takes turns with
            # the backward on the same cores, and every extra collective is one more
            # rendezvous of all ranks: measured on 2 cores, tiny model, stage 0, one
            # bucket instead of three was 3.8% faster per step at 4 ranks and equal at 2.
            groups = buckets_by_size(module, zero.bucket_bytes, dtype.itemsize, bucket_key,
                                     overlap_caps=device.type != "cpu")
            self.buckets = [family_buffer(mesh, g, dtype, device)
                            for g in by_family(groups)]
            for buf in self.buckets:
                buf.materialize_full(init_fn, buf.comm or self.comm,
                                     (*self._owned_range(buf), precision.master))
        check_nothing_left_on_meta(module)
        for buf in self.buckets:
            if not self.stage.shards_gradients:
                buf.full_grad = torch.zeros(buf.padded, dtype=precision.grad_dtype,
                                            device=device)
            else:
                buf.shard_grad = torch.zeros(buf.shard_numel, dtype=precision.reduce,
                                             device=device)
        # AdamW state of each bucket's owned slice, and the ranges of it that the global
        # gradient norm counts on this rank.
        decay = [buf.decay_ranges(*self._owned_range(buf)) for buf in self.buckets]
        self.host: HostOptimizer | None = None
        self.disk: DiskOptimizer | None = None
        self._disk_slices: list[OwnedSlice] | None = None  # read for a checkpoint
        if offload.disk:  # master weights and moments in files (ZeRO-Infinity)
            self.disk = DiskOptimizer.create(
                [self._owned_param(b) for b in self.buckets],
                [self._owned_grad(b).dtype for b in self.buckets], decay, precision.master,
                offload.directory, offload.budget_bytes, f"rank{mesh.rank}",
                params_on_disk=offload.params)
            self.slots = []
            if offload.params:  # the shards are in files now; read per gather
                for buf in self.buckets:
                    buf.shard = torch.empty(0, dtype=dtype, device=device)
        elif offload.optimizer:  # master weights and moments in host memory (ZeRO-Offload)
            self.host = HostOptimizer.create([self._owned_param(b) for b in self.buckets],
                                             [self._owned_grad(b).dtype for b in self.buckets],
                                             decay, precision.master, device)
            self.slots = self.host.slots
        else:
            self.slots = [AdamWState.for_slice(self._owned_param(buf), precision.master, d)
                          for buf, d in zip(self.buckets, decay)]
        self.counted = [self._counted_ranges(buf) for buf in self.buckets]
        # The optimizer casts gradients of another dtype than the master in chunks.
        cast = any(self._owned_grad(b).dtype != precision.master for b in self.buckets)
        largest = max((s.exp_avg.numel() for s in self.slots), default=1)
        on_device = self.host is None and self.disk is None
        self.adam_scratch = adamw_scratch(largest if cast and on_device else 0,
                                          precision.master, device)
        # Host offload: each bucket's reduced gradient streams to host as it lands.
        self.streamed = [False] * len(self.buckets)
        self.reducer = GradReducer(self.buckets, self.comm, self.stage, precision.reduce,
                                   zero.accumulates_in_full_buffer,
                                   self.gatherer.done if self.gatherer else None,
                                   self._grad_reduced if self.host is not None else None)
        # Stages 1-2 gather the updated slices in the next forward's pre-hooks; under
        # host offload stages 0-2 also wait there for the background update.
        gathers = self.stage.gathers_parameters_after_step
        self.param_sync = (ParamAllGather(module, self.buckets, self.comm, gathers,
                                          self.host.wait if self.host is not None else None)
                           if gathers or (self.host is not None and self.gatherer is None)
                           else None)
        # A torch optimizer may step the parameters only where they are a plain replica
        # whose .grad is the averaged gradient (`ownership`).
        self.torch_optimizer_allowed = (self.reducer.bound and self.host is None
                                        and self.disk is None
                                        and not self.stage.shards_optimizer_states)
        start_masters_precisely(self)
        self.state_dict_handles = ownership.state_dict_hooks(module, self)
        self.scaler = LossScaler(precision)
        self.step_count = 0
        self._overflow: bool | None = None  # decided once per step, see _prepare

    # Layout ----------------------------------------------------------------------------
    # The slice of each bucket this rank's optimizer updates: all of it unless the
    # stage shards optimizer states.
    def _owned_range(self, buf: FlatBuffer) -> tuple[int, int]:
        return (buf.lo, buf.hi) if self.stage.shards_optimizer_states else (0, buf.padded)

    def _owned_param(self, buf: FlatBuffer) -> torch.Tensor:
        return buf.owned_param() if self.stage.shards_optimizer_states else buf.full

    def _owned_grad(self, buf: FlatBuffer) -> torch.Tensor:
        if self.stage.shards_gradients:
            return buf.shard_grad
        if self.stage.shards_optimizer_states:
            return buf.full_grad[buf.lo:buf.hi]
        return buf.full_grad

    def _counted_ranges(self, buf: FlatBuffer) -> list[tuple[int, int]]:
        """Ranges of the owned slice that the global gradient norm counts on this rank."""
        lo, hi = self._owned_range(buf)
        counted = []
        for pc in buf.pieces(lo, hi):
            # A copy replicated over another group (a norm under tensor parallelism) is
            # counted by that group's index 0 only.
            dup = any(p in self.mesh.ranks and self.mesh.index(p) != 0
                      for p in pc.entry.info.replicated_over)
            if dup:
                continue
            a = pc.buf_start - lo
            b = a + pc.stop - pc.start
            if counted and counted[-1][1] == a:  # one norm call over adjacent pieces
                counted[-1] = (counted[-1][0], b)
            else:
                counted.append((a, b))
        return counted

    # Backward --------------------------------------------------------------------------
    @contextmanager
    def grad_sync(self, enabled: bool = True, buckets: tuple[int, ...] | None = None):
        """Around one microbatch's backward; enabled=False on all but the last.

        `buckets` (from `buckets_of`): this backward reaches only their parameters (one
        pipeline stage of several on this rank); with enabled=True it is their last
        backward of the step. They are then reduced during it and stay in flight while
        other stages' backwards run; buckets outside every such scope wait for
        finish_grad_sync."""
        self.reducer.begin_round(enabled, buckets)
        yield
        self.reducer.end_round()

    def buckets_of(self, params: list[nn.Parameter]) -> tuple[int, ...]:
        """Indices of the buckets made only of `params`."""
        ids = {id(p) for p in params}
        return tuple(b for b, buf in enumerate(self.buckets)
                     if all(id(p) in ids for p in buf.params))

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss: torch.Tensor) -> None:
        self.reducer.note_backward()
        (loss * self.scaler.scale if self.scaler.enabled else loss).backward()

    def finish_grad_sync(self) -> None:
        """After the last microbatch: launch what is left and wait for every reduction."""
        ownership.check_still_frozen(self.left_out)
        self.reducer.finish()
        if self.gatherer is not None:
            self.gatherer.free_all()
        if self.host is not None:  # what did not stream during backward goes now
            for b, done in enumerate(self.streamed):
                if not done:
                    self._grad_reduced(b, True)

    def _grad_reduced(self, b: int, final: bool) -> None:
        """Host offload: bucket `b`'s reduced owned gradient is in; copy it to host
        unless a later round of this step still adds to it."""
        assert self.host is not None
        if final:
            self.host.stream_grad(b, self._owned_grad(self.buckets[b]))
        self.streamed[b] = final

    def _step_grad(self, buf: FlatBuffer) -> torch.Tensor:
        """The gradient the optimizer reads: under host offload, the host copy."""
        if self.host is not None:
            return self.host.grads[self.buckets.index(buf)]
        return self._owned_grad(buf)

    @torch.no_grad()
    def _prepare(self) -> bool:
        """Finish reductions; for fp16 agree on overflow and unscale. True = overflow."""
        if self._overflow is not None:
            return self._overflow
        self.finish_grad_sync()
        if self.host is not None:
            self.host.join()  # the previous update, if no forward waited for all of it
            self.host.wait_grads()
        overflow = False
        if self.scaler.enabled:
            bad = float(any(not torch.isfinite(self._owned_grad(b)).all() for b in self.buckets))
            bad = self.comm.all_reduce_scalars([bad], op=dist.ReduceOp.MAX)[0]
            overflow = self.mp_comm.all_reduce_scalars([bad], op=dist.ReduceOp.MAX)[0] > 0
            if not overflow:
                for b in self.buckets:
                    self._owned_grad(b).mul_(1.0 / self.scaler.scale)
                    if self.host is not None:  # the copy the update reads
                        self._step_grad(b).mul_(1.0 / self.scaler.scale)
        self._overflow = overflow
        return overflow

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | None) -> float:
        """Exact global gradient norm over every shard and parallel group; clips to
        max_norm (as torch.nn.utils.clip_grad_norm_) unless max_norm is None."""
        if self._prepare():
            return math.inf
        # Each rank counts its own slice when optimizer states are sharded (the reduced
        # gradient is whole on every rank otherwise); model-parallel ranks hold
        # different parameters, each counted once (`_counted_ranges`).
        groups = ([self.comm] if self.stage.shards_optimizer_states else []) + [self.mp_comm]
        local = squared_sum(self._counted_grads(), self.device)
        if not self.stage.shards_optimizer_states and self._expert_buckets():
            # Whole local experts on every rank: the expert group holds different ones.
            experts = squared_sum(self._counted_grads(self._expert_buckets()), self.device)
            local += self.mesh.comm("expert").all_reduce_scalars([experts])[0] - experts
        norm = global_norm(local, groups)
        coef = clip_coefficient(norm, max_norm)
        if coef < 1.0:
            for buf in self.buckets:  # under host offload the device copy is done with
                self._step_grad(buf).mul_(coef)
        return norm

    def _expert_buckets(self) -> list[int]:
        return [b for b, buf in enumerate(self.buckets) if buf.comm is not None]

    def _counted_grads(self, only: list[int] | None = None) -> Iterator[torch.Tensor]:
        for b, (buf, counted) in enumerate(zip(self.buckets, self.counted)):
            if only is not None and b not in only:
                continue
            g = self._owned_grad(buf)
            yield from (g[a:b] for a, b in counted)

    # Optimizer -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float | None = None) -> bool:
        """AdamW on the owned slices, then parameters are ready for the next forward.
        Returns False (on every rank) when an fp16 overflow skipped the step."""
        overflow = self._prepare()
        self._overflow = None
        if overflow:
            self.scaler.update(True)
            self.zero_grad()
            return False
        self.step_count += 1
        lr = self.optim.lr if lr is None else lr
        self.wait_params()
        # Forward order (last bucket first), so that the all-gathers of stages 1 and 2
        # arrive in the order the next forward needs them.
        order = list(reversed(range(len(self.buckets))))
        if self.disk is not None:
            self.disk.step(order, [self._owned_param(b) for b in self.buckets],
                           [self._owned_grad(b) for b in self.buckets], self.step_count, lr,
                           self.optim)
            order = []  # updated; stages 1-2 still gather below
            if self.param_sync is not None:
                for b in reversed(range(len(self.buckets))):
                    self.param_sync.launch(b)
        if self.host is not None:
            # On a background thread, so the next forward overlaps it: each module
            # waits for its own buckets (param_sync's hooks; ZeRO-3: `_stage_in`).
            self.host.start_step(order, [self._owned_param(buf) for buf in self.buckets],
                                 self.step_count, lr, self.optim,
                                 host_shard=self.offload.params)
            if self.param_sync is not None:
                self.param_sync.queue(order)
            order = []
        for b in order:
            buf = self.buckets[b]
            self.slots[b].step_(self._owned_param(buf), self._owned_grad(buf),
                                self.step_count, lr, self.optim, self.adam_scratch)
            if self.param_sync is not None:  # stage 3 gathers lazily before its forward
                self.param_sync.launch(b)
        self.reducer.used()
        self.streamed = [False] * len(self.buckets)  # the host copies are consumed
        self.scaler.update(False)
        return True

    def wait_params(self) -> None:
        """Wait for what step() left running: the parameter all-gathers of stages 1-2
        and, under host offload, the update on the CPU (forward waits by itself, module
        by module). Call it before reading parameters or optimizer states otherwise."""
        if self.param_sync is not None:
            self.param_sync.wait_all()
        if self.host is not None:
            self.host.join()

    def close(self) -> None:
        """Detach the engine from its module: wait for what step() left running and
        remove every hook it put on the module and its parameters. Autograd holds the
        gradient hooks in C++, where Python's collector cannot see the cycle parameter
        -> hook -> engine -> module, so an engine dropped without `close` (and its
        buffers and optimizer states) lives as long as its parameters."""
        self.wait_params()
        if self.gatherer is not None:
            self.gatherer.free_all()
        for part in (self.reducer, self.gatherer, self.param_sync):
            for handle in getattr(part, "handles", None) or ():
                handle.remove()
        for handle in self.state_dict_handles:
            handle.remove()
        ownership.release(self)

    @torch.no_grad()
    def zero_grad(self) -> None:
        self.streamed = [False] * len(self.buckets)
        self.reducer.clear()  # every .grad None; no memset (reducer docstring)
        for buf in self.buckets:
            if buf.shard_grad is not None:
                buf.shard_grad.zero_()
        self._overflow = None

    # Full parameters from user code ----------------------------------------------------
    @contextmanager
    def gathered_parameters(self, writeback: bool = False):
        """Full parameters visible in dp.module inside the block (gathered in stage 3).
        With writeback=True, changes made there (identically on every rank) are kept:
        each rank copies its owned slice back into its shard and master weights."""
        if writeback and self.disk is not None:
            raise PartitaError("writing parameters back under disk offload is not supported "
                               "yet; load a checkpoint into a run without disk offload.")
        with torch.no_grad():
            self.wait_params()
            if self.gatherer is None:
                yield
                if writeback:
                    self._refresh_master()
                return
            with self.gatherer.everything():
                yield
                if writeback:
                    for buf in self.buckets:
                        buf.shard.copy_(buf.full[buf.lo:buf.hi])
                    self._refresh_master()

    def _stage_in(self, buf: FlatBuffer) -> torch.Tensor:
        """Stage 3 under offload: the shard to be gathered, once its update is in; with
        parameters offloaded, copied onto the device from host memory or its file."""
        b = self.buckets.index(buf)
        if self.host is not None:
            self.host.wait(b)  # its update, running since step()
        if not self.offload.params:
            return buf.shard
        if self.disk is not None:
            self.disk.copies.append(("param-in", b, 0))
            return self.disk.read_param(b, self.device)
        assert self.host is not None
        self.host.copies.append(("param-in", b))
        return stage_in(buf.shard, self.device)

    def _refresh_master(self) -> None:
        """After a writeback (refused under disk offload by `gathered_parameters`)."""
        for buf, slot in zip(self.buckets, self.slots):
            slot.load_param_(self._owned_param(buf))

    # Reports and state -----------------------------------------------------------------
    def memory_ledger(self) -> dict[str, int]:
        """Bytes this rank holds, counted from the actual tensors (partita.zero.ledger)."""
        return memory_ledger(self)

    # Checkpoint access (partita.zero.owned) --------------------------------------------
    def owned_slices(self) -> list[OwnedSlice]:
        """Per bucket, what this rank's optimizer updates and where its state lives."""
        return owned_slices(self)

    def writes_piece(self, piece: Piece) -> bool:
        """Whether a checkpoint takes `piece`'s state from this rank."""
        return writes_piece(self, piece)

    def owned_slices_loaded(self) -> None:
        """The owned slices were written from outside (a checkpoint was loaded)."""
        owned_slices_loaded(self)
