"""ZeRO-Offload: the optimizer's states (and, under ZeRO-3, parameter shards) in host memory.

    policy = OffloadPolicy("optimizer")       # or "optimizer+params" (ZeRO-3 only)
    host = HostOptimizer(owned_params, decay_ranges, master_dtype, device)
    host.start_step(order, owned_params, step, lr, cfg)  # forward order, in the background
    host.wait(b)                                          # bucket b updated (forward pre-hook)

What lives where, per flat bucket of the data-parallel engine (`partita.zero`):

- device: the parameters (ZeRO-3: the gathered units only, under "optimizer+params"),
  the gradients the reduction produces, the communication buffers;
- host: the fp32 master copy of the bucket's owned slice (a copy even when the
  parameters are fp32 themselves: the update runs where its states are), both Adam
  moments, a staging buffer the owned gradient is copied into, and under
  "optimizer+params" the owned parameter shard at rest.

Gradients stream to host during backward: the data-parallel engine's reducer calls
back as each bucket's reduction lands (`stream_grad`; on a GPU the copy runs on a side
stream behind the reduction, into page-locked memory, while backward goes on with
earlier layers), so only the buckets reduced last are copied after backward ends. A
bucket a later microbatch still adds to is copied again when it is final; anything
not streamed by the boundary is copied then. Scaling applied to the gradients after
their copy (fp16 unscaling, clipping) is applied to the host copies, which are what
the update reads.

The step (`start_step`), bucket by bucket in the order the next forward needs them, on
a background thread: AdamW runs on the CPU over the flat slice (`partita.optim.adamw_`,
torch's fused CPU kernel: one vectorised pass per slice) and the updated master is
copied back into the device parameters, cast to their dtype (under "optimizer+params"
into the host shard), then the next bucket. The engine returns from its step at once,
so the next forward overlaps the update: each module waits (`wait(b)`, from a forward
pre-hook) only for the buckets its parameters live in; under stages 1-2 each bucket's
all-gather is launched after its wait, in forward order; under ZeRO-3 each gather unit
waits before it is gathered (`optimizer+params`: before its shard is copied to the
device, see `stage_in`). Whatever else touches the states joins the whole step first
(`join()`; `stream_grad` and `load_param_` do so themselves), and an error raised on
the thread is raised again by every later wait or join.
Every copy is recorded in `copies` (direction, bucket), so tests can check the order on
a machine whose host and device are one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from partita.errors import PartitaError
from partita.optim import AdamWConfig, AdamWState, adamw_, adamw_scratch

MODES = ("none", "optimizer", "optimizer+params", "optimizer+disk", "optimizer+params+disk")


@dataclass(frozen=True)
class OffloadPolicy:
    """Which model states live off the device (`mode`, one of MODES). Disk modes keep
    the optimizer's states in files under `directory`, through host buffers of at most
    `budget_bytes` (partita.memory.disk)."""

    mode: str = "none"
    directory: str = ""
    budget_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PartitaError(f"parallel.offload={self.mode!r} is unknown; choose one of "
                               f"{', '.join(MODES)}.")

    @property
    def optimizer(self) -> bool:
        """Master weights and Adam moments on the host, the update on the CPU."""
        return self.mode != "none"

    @property
    def params(self) -> bool:
        """ZeRO-3 parameter shards at rest off the device (host memory, or disk)."""
        return "+params" in self.mode

    @property
    def disk(self) -> bool:
        """Master weights and moments in files, updated in sub-groups."""
        return self.mode.endswith("+disk")


def host_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer; page-locked when the device is a GPU, so copies run asynchronously."""
    pin = torch.device(device).type == "cuda"
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)


@dataclass
class HostOptimizer:
    """AdamW states of each bucket's owned slice in host memory, stepped on the CPU."""

    slots: list[AdamWState]
    grads: list[torch.Tensor]  # host staging of each bucket's owned gradient
    device: torch.device
    scratch: torch.Tensor
    copies: list[tuple[str, int]] = field(default_factory=list)  # ("d2h"|"adam"|"h2d", b)
    _events: dict = field(default_factory=dict)  # bucket -> its copy's CUDA event
    _stream: object = None  # the side stream of the gradient copies (CUDA)
    # The step running in the background (`start_step`): its thread, one event per
    # bucket set once that bucket's parameters hold their new values, its error.
    _thread: threading.Thread | None = None
    _ready: dict[int, threading.Event] = field(default_factory=dict)
    _error: BaseException | None = None

    @classmethod
    def create(cls, owned_params: list[torch.Tensor], grad_dtypes: list[torch.dtype],
               decay: list[list[tuple[int, int]]], master_dtype: torch.dtype,
               device: torch.device) -> HostOptimizer:
        slots, grads = [], []
        for param, gdtype, ranges in zip(owned_params, grad_dtypes, decay):
            master = host_empty(param.numel(), master_dtype, device)
            master.copy_(param)
            moments = [host_empty(param.numel(), master_dtype, device).zero_()
                       for _ in range(2)]
            slots.append(AdamWState(master, moments[0], moments[1], ranges))
            grads.append(host_empty(param.numel(), gdtype, device))
        cast = any(g.dtype != master_dtype for g in grads)
        largest = max((g.numel() for g in grads), default=1)
        scratch = adamw_scratch(largest if cast else 0, master_dtype, torch.device("cpu"))
        return cls(slots, grads, torch.device(device), scratch)

    def stream_grad(self, b: int, grad: torch.Tensor) -> None:
        """Start copying bucket `b`'s reduced owned gradient to its host buffer (on a
        GPU behind the work queued so far, on a side stream)."""
        self.join()  # the previous step may still be reading this staging buffer
        if self.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self.grads[b].copy_(grad, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._events[b] = event
        else:
            self.grads[b].copy_(grad)
        self.copies.append(("d2h", b))

    def wait_grads(self) -> None:
        """Every gradient copy issued so far has landed (the device gradients may be
        written again, the host copies read)."""
        for event in self._events.values():
            event.synchronize()
        self._events.clear()

    def step(self, b: int, param: torch.Tensor, step: int, lr: float, cfg: AdamWConfig,
             host_shard: bool = False) -> None:
        """AdamW on bucket `b`'s host states, then its updated values into `param`:
        the device slice ("h2d"), or under "optimizer+params" the host shard ("shard")."""
        slot = self.slots[b]
        adamw_(slot.master, self.grads[b], slot.exp_avg, slot.exp_avg_sq, step, lr, cfg,
               slot.decay, self.scratch)
        self.copies.append(("adam", b))
        param.copy_(slot.master, non_blocking=not host_shard and self.device.type != "cpu")
        self.copies.append(("shard" if host_shard else "h2d", b))

    def start_step(self, order: Sequence[int], params: Sequence[torch.Tensor], step: int,
                   lr: float, cfg: AdamWConfig, host_shard: bool = False) -> None:
        """`step` for every bucket of `order` (indices into `params`), in that order, on
        a background thread, so that the next forward can begin with the first buckets
        while the CPU updates the later ones. `wait(b)` waits for one bucket, `join()`
        for all; an error raised there is raised again by both."""
        self.join()
        self._ready = {b: threading.Event() for b in order}
        # The thread copies on the caller's stream, so the forward queued after a
        # `wait` on that stream runs after the copy.
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

        def run() -> None:
            try:
                with torch.no_grad(), torch.cuda.stream(stream):  # grad mode is per thread
                    for b in order:
                        self.step(b, params[b], step, lr, cfg, host_shard)
                        self._ready[b].set()
            except BaseException as err:  # raised again in the training thread
                self._error = err
            finally:
                for event in self._ready.values():  # no waiter blocks on a failed step
                    event.set()

        self._thread = threading.Thread(target=run, name="partita-host-adamw", daemon=True)
        self._thread.start()

    def wait(self, b: int) -> None:
        """Bucket `b`'s parameters hold their updated values (no-op outside a step)."""
        event = self._ready.get(b)
        if event is not None:
            event.wait()
        self._raise()

    def join(self) -> None:
        """The whole background step is over: every state may be read or written."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        # Sticky: after a failed step the states are half updated, so every later
        # wait fails too rather than train on them.
        if self._error is not None:
            raise PartitaError(f"the host optimizer step failed: {self._error!r}") \
                from self._error

    def load_param_(self, b: int, param: torch.Tensor) -> None:
        """`param` was written from outside: the host master follows it."""
        self.join()
        self.slots[b].master.copy_(param)

    def bytes(self) -> dict[str, int]:
        """Host bytes by category."""
        def n(ts):
            return sum(t.numel() * t.element_size() for t in ts)
        return {"master_weights": n(s.master for s in self.slots),
                "optimizer_states": n(t for s in self.slots for t in (s.exp_avg, s.exp_avg_sq)),
                "gradients": n(self.grads)}


def stage_in(shard: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host parameter shard, copied to the device for the all-gather that reads it."""
    out = torch.empty(shard.shape, dtype=shard.dtype, device=device)
    return out.copy_(shard, non_blocking=True)
