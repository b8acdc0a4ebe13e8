"""Before a CPU job starts: will its processes fit in this machine's memory?

A model too large for the host otherwise starts, grows until the kernel's out-of-memory
killer ends a process, and reports only that something died (or, with swap, slows the
whole machine for minutes first). The planner already predicts every byte a process
holds (model states, activations, buffers, the loss; within 1% of partita's measured
bytes, `bench plan-accuracy`), so the launcher asks it before starting anything and
refuses a job that needs more than the machine has available, naming the smallest
change that would fit. Under torchrun every process asks before it builds anything,
for its node's processes against its node's memory, and the node's first process says
why (`commands.train`). `train.host_memory_check = false` starts it anyway.

GPU jobs are refused only for the states they offload to host memory
(`check_offloaded_states`). Their device's memory gets a note before launch where the
planner expects the layout beyond it (`device_memory_note`), and a process that runs
out of memory all the same says what the planner expects it to hold and what would fit
(`device_memory_advice`; `host_memory_advice` for a CPU's failed allocation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from partita.config import Config, with_overrides
from partita.errors import PartitaError
from partita.layout_rules import validate
from partita.machine_cache import meminfo_bytes

# What a training process holds beyond its tensors: the interpreter, torch and its
# libraries' private pages, gloo's buffers. The default run's workers measured 145-166
# MB proportional set size each, their tensors ~10 MB (2026-12-07, /proc/PID/smaps_rollup).
PROCESS_BASELINE_BYTES = 0.2e9
WARN_FRACTION = 0.8  # above this share of the available memory a note says so

# Changes tried, one after another and kept, when a job does not fit, after more
# microbatches (`_microbatch_remedies`): each cuts what the one before left largest on
# a CPU (the states, then activations, then the bytes per element, then the host copy).
_REMEDIES = ("--parallel.zero_stage=3", "--parallel.recompute=full",
             "--precision.param_dtype=bfloat16", "--parallel.offload=optimizer+params+disk")
# The same for a device's memory: recomputation before bf16 there (GPUs train in 16 bits
# already, mostly), and the optimizer's states moved to host memory last.
_DEVICE_REMEDIES = ("--parallel.zero_stage=3", "--parallel.recompute=selective",
                    "--parallel.recompute=full", "--precision.param_dtype=bfloat16",
                    "--parallel.offload=optimizer")


@dataclass(frozen=True)
class HostNeed:
    """Bytes one machine's processes need, as the planner predicts them."""

    processes: int
    tensor_bytes: float  # summed over the processes: states, activations, buffers
    states_bytes: float  # of which model states (on the device and offloaded to host)
    shared_bytes: float = 0.0  # /dev/shm of the shared-memory transports (`shared_memory_bytes`)

    @property
    def total(self) -> float:
        return self.tensor_bytes + self.processes * PROCESS_BASELINE_BYTES + self.shared_bytes


def shared_memory_bytes(cfg: Config, world_size: int) -> int:
    """The most /dev/shm (memory: a tmpfs) the job's gloo groups take on one machine
    that runs all of its processes: a collectives arena per group of two or more
    (`partita.shm_collectives`; each is made by the group's first flat collective, so
    this counts every group), the pipeline's rings (and its tied embedding's), ring
    attention's. 0 where the transports are off."""
    from partita import shm_channel, shm_collectives, shm_share
    from partita.mesh import all_groups
    from partita.pipeline.p2p import neighbour_pairs

    if not (shm_share.wanted(None) and shm_share.supported()):
        return 0
    layout = cfg.layout(world_size)
    groups = {tuple(members) for purpose, found in all_groups(layout.degrees).items()
              if purpose != "embedding" for members in found if len(members) > 1}
    total = sum(shm_collectives.arena_bytes(len(g)) for g in groups)
    if shm_collectives.floor_bytes() == 0:  # the rings need no floor (`shm_channel`)
        p, v = layout.pp, layout.virtual_stages
        if p > 1:
            pairs = neighbour_pairs(p * v, lambda s: s % p)
            tied = 2 if cfg.model_config().tie_embeddings else 0  # first <-> last stage
            total += world_size // p * sum(shm_channel.arena_bytes(n) for n in (len(pairs), tied)
                                           if n)
        c = layout.cp
        if c > 1 and cfg.parallel.cp_kind == "ring":
            total += world_size // c * shm_channel.arena_bytes(c * (c - 1))
    return total


def _plan_inputs(cfg: Config, world_size: int, on_gpu: bool = False):
    """(layout, planner model, assumptions, precision) of this config, as the planner
    sees the job (on a CPU, or with `on_gpu` on a GPU)."""
    from partita.planner import Assumptions, PlanModel
    from partita.planner.compiled import compiled_activations
    from partita.planner.evaluate import with_kept_units

    model = PlanModel("run", cfg.model_config())
    base = Assumptions.partita_on_gpu() if on_gpu else Assumptions.measured_cpu()
    a = compiled_activations(base, model, cfg.train.compile)
    a = dataclasses.replace(with_kept_units(a, cfg.parallel.keep_gathered),
                            disk_host_budget_bytes=cfg.parallel.host_memory_budget_gb * 1e9)
    return cfg.layout(world_size), model, a, plan_precision(cfg)


def host_need(cfg: Config, world_size: int, local_processes: int) -> HostNeed:
    """What `local_processes` ranks of this job hold on one machine. On one machine
    every pipeline stage's ranks are counted with their own stage's bytes; over
    several, each process is taken at the stages' mean."""
    from partita.planner.memory import host_state_bytes, memory_breakdown
    from partita.planner.timing import num_microbatches

    layout, model, a, precision = _plan_inputs(cfg, world_size)
    m = num_microbatches(layout, cfg.train.global_batch)
    tensors, states = [], []
    for stage in range(layout.pp):
        b = memory_breakdown(model, layout, cfg.data.seq_len, m, stage, precision, a)
        host = host_state_bytes(model, layout, precision, stage, a)
        tensors.append(b["total"] + host)
        states.append(host + sum(b[k] for k in ("parameters", "gradients",
                                                "master_weights", "optimizer_states")))
    per_process = local_processes / layout.pp
    shared = shared_memory_bytes(cfg, world_size) if local_processes == world_size else 0
    return HostNeed(local_processes, per_process * sum(tensors), per_process * sum(states),
                    shared)


def plan_precision(cfg: Config):
    """The planner's bytes per parameter for this config's dtypes (as
    `parallelize.engine_policies` sets them: fp32 master weights and moments under a
    16-bit parameter dtype unless precision.master_weights is off)."""
    from partita.planner import Precision

    size = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
    param = size.get(cfg.param_dtype_name, 4)
    reduce = size.get(cfg.reduce_dtype_name, param)
    if param >= 4:
        return Precision(param=param, grad=max(param, reduce), master=0,
                         optimizer=2 * param, activation=param)
    master = 4 if cfg.precision.master_weights else 0
    return Precision(param=param, grad=max(param, reduce), master=master,
                     optimizer=2 * (master or param), activation=param)


def check_host_memory(cfg: Config, world_size: int, local_processes: int,
                      available: float | None = None) -> str | None:
    """Raise PartitaError when this machine's share of the job needs more memory than
    is available; return a note when it needs most of it, else None."""
    if not cfg.train.host_memory_check:
        return None
    # MemAvailable: what the kernel can hand out without swapping, page cache included.
    available = meminfo_bytes("MemAvailable") if available is None else available
    if available is None:
        return None
    need = host_need(cfg, world_size, local_processes)
    if need.total <= available:
        if need.total > WARN_FRACTION * available:
            return (f"partita: note: this job needs about {_gb(need.total)} of the "
                    f"{_gb(available)} this machine has available; other programs "
                    "starting meanwhile may push it out of memory.")
        return None
    n = local_processes
    per = "" if n == 1 else f" for its {n} processes"
    shared = (f", {need.shared_bytes / 2**20:.0f} MiB of shared memory (/dev/shm) for "
              "their transfers" if need.shared_bytes else "")
    fix = _remedy(cfg, world_size, _host(world_size, local_processes), available)
    raise PartitaError(
        f"this job needs about {_gb(need.total)} of memory{per} ({_gb(need.states_bytes)} "
        f"of model states, {_gb(need.tensor_bytes - need.states_bytes)} of activations "
        f"and buffers, {_gb(n * PROCESS_BASELINE_BYTES)} for the processes themselves"
        f"{shared}), "
        f"and this machine has {_gb(available)} available, so the out-of-memory killer "
        f"would end it. {fix} To start it anyway, add --train.host_memory_check=false.")


def check_offloaded_states(cfg: Config, world_size: int, local_processes: int,
                           available: float | None = None) -> None:
    """A GPU job that offloads model states to host memory (`parallel.offload`): raise
    PartitaError when the states this machine's processes offload need more than it has
    available. Only the offloaded states are counted: what CUDA's libraries and the
    rest of a GPU process hold on the host is not known before it runs, so a job this
    refuses cannot fit, and one it lets start may still not."""
    if not cfg.train.host_memory_check or cfg.parallel.offload == "none":
        return
    available = meminfo_bytes("MemAvailable") if available is None else available
    if available is None:
        return
    states = offloaded_bytes(cfg, world_size, local_processes)
    if states <= available:
        return
    n, offload = local_processes, cfg.parallel.offload
    per = "" if n == 1 else f" for its {n} processes"
    fixes = ["spread the job over more machines (--nnodes): the data-parallel ranks "
             "shard the offloaded states"]
    if not offload.endswith("+disk"):
        fixes.insert(0, f"--parallel.offload={offload}+disk keeps only buffers on the host")
    raise PartitaError(
        f"this job offloads about {_gb(states)} of model states to host memory{per} "
        f"(parallel.offload={offload}), and this machine has {_gb(available)} "
        f"available, so the out-of-memory killer would end it: {'; or '.join(fixes)}. "
        "To start it anyway, add --train.host_memory_check=false.")


def offloaded_bytes(cfg: Config, world_size: int, local_processes: int) -> float:
    """Host bytes of the states that `local_processes` GPU ranks of this job offload
    (`planner.memory.host_state_bytes`), each pipeline stage's ranks at their own."""
    from partita.planner.memory import host_state_bytes

    layout, model, a, precision = _plan_inputs(cfg, world_size)
    per_stage = [host_state_bytes(model, layout, precision, stage, a)
                 for stage in range(layout.pp)]
    return local_processes / layout.pp * sum(per_stage)


def device_memory_advice(cfg: Config, world_size: int, device_bytes: float | None) -> str:
    """For a process that ran out of device memory (`errors.OutOfDeviceMemory`): what
    the planner expects one process of this layout to hold at its peak, and the first
    of the cumulative changes that brings it within the device (or, its size unknown,
    the first change that lowers it)."""
    b = _device_peak(cfg, world_size)
    states = sum(b[k] for k in ("parameters", "gradients", "master_weights", "optimizer_states"))
    of = f" of the device's {_gb(device_bytes)}" if device_bytes else ""
    said = (f"The planner expects one process of this layout to hold about {_gb(b['total'])}"
            f"{of} at its peak ({_gb(states)} of model states, {_gb(b['activations'])} of "
            f"activations, {_gb(b['comm_buffers'])} of communication buffers).")
    within = bool(device_bytes) and b["total"] <= 0.9 * device_bytes
    if within:
        said += (" That is within the device: other processes on it, fragmentation (try "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or what the planner "
                 "does not model may take the rest.")
    # Aimed a little under the device, which the allocator never fills to the byte; with
    # its size unknown, or the peak already under it, at anything below the present peak.
    if device_bytes and not within:
        target, fits = 0.9 * device_bytes, "It would fit with"
    else:
        target = 0.99 * b["total"]
        fits = "Lowering the peak helps either way:" if within else "It would hold less with"
    fix = _remedy(cfg, world_size, lambda t: _device_peak(t, world_size)["total"], target,
                  _DEVICE_REMEDIES, fits)
    return f"{said} {fix}"


def _device_peak(cfg: Config, world_size: int) -> dict[str, float]:
    """The planner's bytes on one GPU of the layout's largest pipeline stage, by part."""
    from partita.planner.memory import memory_breakdown
    from partita.planner.timing import num_microbatches

    layout, model, a, precision = _plan_inputs(cfg, world_size, on_gpu=True)
    m = num_microbatches(layout, cfg.train.global_batch)
    return max((memory_breakdown(model, layout, cfg.data.seq_len, m, stage, precision, a)
                for stage in range(layout.pp)), key=lambda b: b["total"])


def device_memory_note(cfg: Config, world_size: int, device_bytes: float | None) -> str | None:
    """Before a GPU job starts: a note when the planner expects one process of the layout
    to hold more than its GPU (`device_bytes`), with the change that would fit; None
    otherwise. A note, not a refusal: on a GPU the planner's bytes were checked for one
    model on one H200 (0.8-0.9% under the measured peak, docs/benchmarks.md), not
    across layouts and allocators as on a CPU."""
    if not device_bytes or _device_peak(cfg, world_size)["total"] <= device_bytes:
        return None
    return ("partita: note: this job will likely run out of GPU memory. "
            f"{device_memory_advice(cfg, world_size, device_bytes)}")


def host_memory_advice(cfg: Config, world_size: int, local_processes: int) -> str:
    """For a CPU process whose allocation failed (`errors.OutOfDeviceMemory`, `on_cpu`):
    what the planner expects this machine's processes to hold against its memory, and
    the first of the cumulative changes that brings them under it."""
    total = meminfo_bytes("MemTotal")
    host = _host(world_size, local_processes)
    need = host(cfg)
    of = f" of its {_gb(total)}" if total else ""
    said = (f"The planner expects this machine's {local_processes} process(es) to hold "
            f"about {_gb(need)}{of}.")
    if total and need > 0.9 * total:
        return f"{said} {_remedy(cfg, world_size, host, 0.9 * total)}"
    said += (" That leaves room: other programs may hold the rest, or what the planner "
             "does not model.")
    fix = _remedy(cfg, world_size, host, 0.99 * need, _REMEDIES,
                  "Lowering it helps either way:")
    return f"{said} {fix}"


def _host(world_size: int, local_processes: int) -> Callable[[Config], float]:
    """What a config needs of this machine's memory (`host_need`), as `_remedy` asks."""
    return lambda trial: host_need(trial, world_size, local_processes).total


def _remedy(cfg: Config, world_size: int, need_of: Callable[[Config], float],
            available: float, remedies: tuple[str, ...] = _REMEDIES,
            fits: str = "It would fit with") -> str:
    """The first of the cumulative changes that fits (more microbatches, then each of
    `remedies`) within `available` by `need_of`, or the least they reach together."""
    flags: list[str] = []
    least = None
    for flag in (*_microbatch_remedies(cfg, world_size), *remedies):
        try:
            trial = with_overrides(cfg, [flag])
            if trial == cfg:
                continue  # already so: nothing to name
            layout = trial.layout(world_size)
            validate(layout, trial.model_config(), world_size,
                     seq_len=trial.data.seq_len, global_batch=trial.train.global_batch)
            need = need_of(trial)
        except PartitaError:
            continue  # not a layout this job can take (ZeRO-3 with a pipeline, ...)
        if flags and flags[-1].split("=")[0] == flag.split("=")[0]:
            flags.pop()  # a larger count, or full recompute, replaces the one before
        cfg, least = trial, need
        flags.append(flag)
        if need <= available:
            return f"{fits} {' '.join(flags)} (about {_gb(need)})."
    if least is None:
        return "Choose a smaller model (model.name or its dimensions)."
    return (f"Even with {' '.join(flags)} it would need about {_gb(least)}: choose a "
            "smaller model, or spread the job over more machines (--nnodes).")


def _microbatch_remedies(cfg: Config, world_size: int) -> list[str]:
    """Gradient accumulation, which holds one microbatch's activations at a time and
    changes no result: train.microbatches doubled up to one sequence per microbatch.
    Each replaces the one before (only the last one kept counts)."""
    try:
        layout = cfg.layout(world_size)
    except PartitaError:
        return []
    local, m = cfg.train.global_batch // layout.dp, cfg.train.microbatches * 2
    counts = []
    while m <= local:
        counts += [m] if local % m == 0 else []
        m *= 2
    if local > cfg.train.microbatches and local not in counts:
        counts.append(local)
    return [f"--train.microbatches={c}" for c in counts]


def _gb(n: float) -> str:
    """Bytes for a message: GB from one up, MB below (a small model's figures)."""
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    if n == 0:
        return "0 MB"
    return f"{n / 1e6:.1f} MB" if n < 1e7 else f"{n / 1e6:.0f} MB"
