"""When nothing fits: the smallest change that would make something fit.

Candidate changes are tried from least to most disruptive: first knobs that cost only
speed (recompute, ZeRO stage, offload, a smaller microbatch), then changes to the
training run (a shorter sequence), then to the cluster (more GPUs, a larger GPU).
Each suggestion names the change and the layout that then fits.
"""

from __future__ import annotations

from dataclasses import replace

from partita.planner.evaluate import MEMORY, Evaluation, Request, evaluate
from partita.planner.hardware import GPUS
from partita.planner.layout import Layout
from partita.planner.search import FULL_SPACE, SearchSpace, search


def advise_layout(req: Request, ev: Evaluation, limit: int = 3) -> list[str]:
    """Changes to one layout that does not fit in memory, least disruptive first."""
    if ev.fits or any(k != MEMORY for k, _ in ev.reasons):
        return []
    lay = ev.layout
    tries: list[tuple[str, Layout]] = []
    for rc in ("selective", "full"):
        if _order(rc) > _order(lay.recompute):
            tries.append((f"recompute={rc}", lay.with_(recompute=rc)))
    for z in range(lay.zero + 1, 4 if lay.pp == 1 else 3):
        tries.append((f"zero={z}", lay.with_(zero=z)))
    if lay.offload == "none":
        tries.append(("offload=optimizer", lay.with_(offload="optimizer")))
    mb = lay.mb // 2
    while mb >= 1:
        tries.append((f"mb={mb}", lay.with_(mb=mb)))
        mb //= 2
    tries.append(("recompute=full offload=optimizer",
                  lay.with_(recompute="full", offload="optimizer", mb=1)))
    out = [f"{change}: {trial.describe()} fits" for change, trial in tries
           if evaluate(req, trial).fits]
    if len(out) < limit:
        out += _request_changes(req, lambda r: _fits_scaled(r, lay), limit - len(out))
    return out[:limit]


def advise_search(req: Request, space: SearchSpace = FULL_SPACE, limit: int = 3) -> list[str]:
    """Changes to the request when no layout of the search space fits."""
    out = []
    full = FULL_SPACE
    if space != full:
        best = search(req, full).best
        if best is not None:
            out.append(f"allow every recompute/offload/ZeRO/microbatch choice: "
                       f"{best.layout.describe()} fits")

    def best_of(r: Request) -> Layout | None:
        found = search(r, full).best
        return found.layout if found else None

    out += _request_changes(req, best_of, limit - len(out))
    return out[:limit]


def _request_changes(req: Request, fits, limit: int) -> list[str]:
    """Shorter sequences, more GPUs, a GPU with more memory: the first that works of each."""
    out: list[str] = []
    seq = req.seq_len // 2
    while seq >= 128 and len(out) < limit:
        layout = fits(replace(req, seq_len=seq))
        if layout is not None:
            out.append(f"a shorter sequence, --seq-len {seq}: {layout.describe()} fits")
            break
        seq //= 2
    n = req.cluster.num_gpus * 2
    while n <= req.cluster.num_gpus * 64 and len(out) < limit:
        layout = fits(replace(req, cluster=replace(req.cluster, num_gpus=n)))
        if layout is not None:
            out.append(f"more GPUs, --gpus {n}: {layout.describe()} fits")
            break
        n *= 2
    for name, gpu in sorted(GPUS.items(), key=lambda kv: kv[1].memory_bytes):
        if len(out) >= limit or gpu.memory_bytes <= req.cluster.gpu.memory_bytes:
            continue
        layout = fits(replace(req, cluster=replace(req.cluster, gpu=gpu)))
        if layout is not None:
            out.append(f"a GPU with more memory, --gpu-type {name}: {layout.describe()} fits")
            break
    return out


def _fits_scaled(req: Request, layout: Layout) -> Layout | None:
    """`layout` adapted to `req` (dp rescaled to the GPU count), if it then fits."""
    other = layout.tp * layout.pp * layout.cp
    n = req.cluster.num_gpus
    if n % other:
        return None
    trial = layout.with_(dp=n // other)
    if req.global_batch % (trial.dp * trial.mb):
        # Keep the per-replica batch whole: more replicas share the same global batch.
        return None
    return trial if evaluate(req, trial).fits else None


def _order(recompute: str) -> int:
    return ("none", "selective", "full").index(recompute)

