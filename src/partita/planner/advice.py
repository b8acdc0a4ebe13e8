"""When nothing fits: the smallest change that would make something fit.

Candidate changes are tried from least to most disruptive: first knobs that cost only
speed (ZeRO stage, a smaller microbatch, recomputation, then offload to host memory or
disk, which costs the most), then changes to the training run (a shorter sequence),
then to the cluster (more GPUs, a larger GPU). Only layouts `partita train` runs are
suggested. Each suggestion names the change and the layout that then fits.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from partita.layout import MOE_TP, OFFLOAD, Layout
from partita.planner.evaluate import MEMORY, Evaluation, Request, evaluate, layout_text
from partita.planner.hardware import GPUS
from partita.planner.search import DEFAULT_SPACE, SearchSpace, search


def advise_layout(req: Request, ev: Evaluation, limit: int = 3) -> list[str]:
    """Changes to one layout that does not fit in memory: the fewest knobs changed first
    (ZeRO stage, microbatch size, recompute; an MoE model's moe_tp under tp), the
    fastest result among equals, then the same with offload; then changes to the
    request."""
    if ev.fits or any(k != MEMORY for k, _ in ev.reasons):
        return []
    lay = ev.layout
    zeros = list(range(lay.zero_stage, 4 if lay.pp == 1 else 3))
    mbs = [lay.microbatch_size >> i for i in range(lay.microbatch_size.bit_length())
           if lay.microbatch_size % (lay.microbatch_size >> i) == 0]
    found: list[tuple[bool, int, float, str]] = []
    names = ("zero_stage", "microbatch_size", "recompute", "offload", "moe_tp")
    recomputes = [lay.recompute] + [r for r in ("selective", "full") if r != lay.recompute]
    offloads = [lay.offload] + [o for o in OFFLOAD if o != lay.offload]
    # MoE blocks under tp: splitting the experts over the tp ranks divides their memory.
    moe_tps = [lay.moe_tp] + ([m for m in MOE_TP if m != lay.moe_tp]
                              if req.model.is_moe and lay.tp > 1 else [])
    for z, mb, rc, off, mt in itertools.product(zeros, mbs, recomputes, offloads, moe_tps):
        trial = lay.with_(zero_stage=z, microbatch_size=mb, recompute=rc, offload=off,
                          moe_tp=mt)
        changes = [f"{k}={getattr(trial, k)}" for k in names
                   if getattr(trial, k) != getattr(lay, k)]
        if not changes:
            continue
        result = evaluate(req, trial)
        if result.fits:
            found.append((off != lay.offload, len(changes), result.time["step_s"],
                          f"{' '.join(changes)}: {layout_text(trial)} fits"
                          f"{_offload_note(result)}"))
    found.sort()
    out = [text for *_, text in found[:limit]]
    if len(out) < limit:
        # The request changes also try the layout with every memory-saving knob turned.
        saving = lay.with_(zero_stage=zeros[-1], microbatch_size=1, recompute="full")
        out += _request_changes(req, lambda r: _fits_scaled(r, lay) or _fits_scaled(r, saving),
                                limit - len(out))
    return out[:limit]


def advise_search(req: Request, space: SearchSpace = DEFAULT_SPACE, limit: int = 3) -> list[str]:
    """What to change when no layout of the search space fits: the space's own limits
    (pins from `--fix` first), then offload, then the request (sequence length, GPU
    count, GPU type)."""
    out = []
    full = DEFAULT_SPACE
    if space != full:
        best = search(req, full).best
        if best is not None:
            relax = (f"drop --fix {fix_text(space.fixed)}" if space.fixed
                     else "allow every ZeRO stage, schedule and microbatch size")
            out.append(f"{relax}: {layout_text(best.layout)} fits")

    if len(out) < limit:
        out += _offload_changes(req, space, limit - len(out))

    # The request changes keep the pins: a layout outside them is not what was asked
    # for (dropping them is the first suggestion above, named as such).
    within = space if space.fixed else full

    def best_of(r: Request) -> Layout | None:
        found = search(r, within).best
        return found.layout if found else None

    keeping = f" (keeping --fix {fix_text(space.fixed)})" if space.fixed else ""
    out += _request_changes(req, best_of, limit - len(out), keeping)
    return out[:limit]


def fix_text(fixed: tuple[tuple[str, object], ...]) -> str:
    """Pinned layout fields as `--fix` reads them: `tp=8,pp=8`."""
    return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fixed)


def _offload_changes(req: Request, space: SearchSpace, limit: int) -> list[str]:
    """The first offload mode (host memory before disk) with which some layout fits,
    keeping the space's pins; nothing when the pins already choose the offload."""
    if limit < 1 or space.pinned("offload", None) is not None:
        return []
    base = space if space.fixed else DEFAULT_SPACE
    for mode in OFFLOAD[1:]:
        fixed = space.fixed + (("offload", mode),)
        best = search(req, replace(base, offload=(mode,), fixed=fixed)).best
        if best is not None:
            where = "disk" if mode.endswith("+disk") else "host memory"
            return [f"offload to {where}, --fix {fix_text(fixed)}: {layout_text(best.layout)} "
                    f"fits{_offload_note(best)}"]
    return []


def _offload_note(ev: Evaluation) -> str:
    """What an offloading layout costs: step time, host memory and disk per node."""
    if ev.layout.offload == "none":
        return ""
    step = ev.time["step_s"]
    step_text = f"{step:.0f}" if step >= 100 else f"{step:.3g}"
    disk = (f", {ev.disk_bytes_per_node / 1e9:.0f} GB of disk"
            if ev.disk_bytes_per_node else "")
    return (f" ({step_text} s per step; {ev.host_bytes_per_node / 1e9:.0f} GB of host "
            f"memory{disk} per node)")


def _request_changes(req: Request, fits, limit: int, keeping: str = "") -> list[str]:
    """Shorter sequences, more GPUs, a GPU with more memory: the first that works of each
    (`keeping` is added to each change, e.g. the pins it keeps)."""
    out: list[str] = []
    seq = req.seq_len // 2
    while seq >= 128 and len(out) < limit:
        layout = fits(replace(req, seq_len=seq))
        if layout is not None:
            out.append(f"a shorter sequence, --seq-len {seq}{keeping}: {layout_text(layout)} "
                       "fits")
            break
        seq //= 2
    n = req.cluster.num_gpus * 2
    while n <= req.cluster.num_gpus * 64 and len(out) < limit:
        layout = fits(replace(req, cluster=replace(req.cluster, num_gpus=n)))
        if layout is not None:
            out.append(f"more GPUs, --gpus {n}{keeping}: {layout_text(layout)} fits")
            break
        n *= 2
    for name, gpu in sorted(GPUS.items(), key=lambda kv: kv[1].memory_bytes):
        if len(out) >= limit or gpu.memory_bytes <= req.cluster.gpu.memory_bytes:
            continue
        layout = fits(replace(req, cluster=replace(req.cluster, gpu=gpu)))
        if layout is not None:
            out.append(f"a GPU with more memory, --gpu-type {name}{keeping}: "
                       f"{layout_text(layout)} fits")
            break
    return out


def _fits_scaled(req: Request, layout: Layout) -> Layout | None:
    """`layout` adapted to `req` (dp rescaled to the GPU count), if it then fits."""
    other = layout.tp * layout.pp * layout.cp
    n = req.cluster.num_gpus
    if n % other:
        return None
    trial = layout.with_(dp=n // other)
    if req.global_batch % (trial.dp * trial.microbatch_size):
        # Keep the per-replica batch whole: more replicas share the same global batch.
        return None
    return trial if evaluate(req, trial).fits else None


