"""ZeRO-Offload: the optimizer's states (and, under ZeRO-3, parameter shards) in host memory.

    policy = OffloadPolicy("optimizer")       # or "optimizer+params" (ZeRO-3 only)
    host = HostOptimizer(owned_params, decay_ranges, master_dtype, device)
    host.step(b, owned_param, owned_grad, step, lr, cfg)   # per bucket, forward order

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

The step, bucket by bucket in the order the next forward needs them: AdamW runs on
the CPU over the flat slice (`partita.optim.adamw_`, torch's fused CPU kernel: one
vectorised pass per slice) and the updated master is copied back into the device
parameters, cast to their dtype, while the CPU goes on to the next bucket (under
"optimizer+params" into the host shard: ZeRO-3 copies a shard to the device, prefetched
like the all-gathers, when it gathers it, see `stage_in`; under stages 1-2 each
bucket's all-gather follows its copy and the next forward waits module by module).
Every copy is recorded in `copies` (direction, bucket), so tests can check the order on
a machine whose host and device are one.
"""

from __future__ import annotations

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

    def load_param_(self, b: int, param: torch.Tensor) -> None:
        """`param` was written from outside: the host master follows it."""
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
