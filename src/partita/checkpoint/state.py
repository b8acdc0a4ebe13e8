"""What a rank contributes to a checkpoint, copied off its training buffers.

`capture(pm)` returns a `RankState`: host copies of the pieces of parameters, master
weights and AdamW moments this rank is the writer of (`DataParallel.writes_piece`: one
rank per set of identical copies), each named by its global parameter and slice, plus
every random stream of the rank. It comes in two parts so that an asynchronous save
can copy beside training: `plan_capture` on the training thread (which pieces, the
random streams), `copy_state` on the writer's thread; training waits for the copy only
before its next optimizer step, the first thing that changes what is copied.

Random streams: torch's default generator (CPU and, on a GPU run, CUDA), any module's
own generators (`checkpointed_generators(device)`, e.g. tensor-parallel dropout), and
Python's and numpy's global generators. They go back in only when the layout is
unchanged (the same rank then plays the same part); see `restore_rng`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from partita.checkpoint.regions import Region

# Training state per parameter element, as the manifest names it.
WEIGHTS, MASTER, EXP_AVG, EXP_AVG_SQ = "param", "master", "exp_avg", "exp_avg_sq"
STATES = (WEIGHTS, MASTER, EXP_AVG, EXP_AVG_SQ)
RNG_PREFIX = "rng/"


@dataclass
class PieceState:
    """One piece of one global parameter: its region and, per state, the key of the
    tensor that holds it in this rank's file."""

    name: str
    region: Region
    keys: dict[str, str]

    def to_json(self) -> dict:
        r = self.region
        out = {"name": self.name, "split": None if r.dim is None else [r.dim, r.start, r.stop],
               "flat": [r.lo, r.hi], "keys": self.keys}
        if r.more:  # cut along further dimensions too (written only then)
            out["more"] = [list(c) for c in r.more]
        return out


@dataclass
class RankState:
    """A rank's share of a checkpoint, in host memory."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    pieces: list[PieceState] = field(default_factory=list)
    shapes: dict[str, list[int]] = field(default_factory=dict)  # global shape per name
    rng: dict = field(default_factory=dict)  # the JSON part of the random streams

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def piece_key(name: str, state: str, region: Region) -> str:
    split = "whole" if region.dim is None else f"d{region.dim}:{region.start}:{region.stop}"
    split += "".join(f"+d{d}:{a}:{b}" for d, a, b in region.more)
    return f"{name}|{state}|{split}|{region.lo}:{region.hi}"


@dataclass
class Capture:
    """What a save will copy, decided on the training thread: the owned slices (views
    of the engine's buffers) and the pieces of each this rank writes, and the random
    streams (copied at once: the next forward advances them)."""

    slices: list = field(default_factory=list)  # (OwnedSlice, pieces this rank writes)
    rng_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    rng: dict = field(default_factory=dict)


def plan_capture(pm) -> Capture:
    """The training thread's part of a save: cheap, and the only part that reads the
    engine's bookkeeping (`copy_state` then only reads tensors)."""
    out = Capture()
    dp = pm.dp
    for sl in dp.owned_slices():
        mine = [pc for pc in sl.pieces if dp.writes_piece(pc)]
        if mine:
            out.slices.append((sl, mine))
    out.rng = _capture_rng(pm.module, pm.device, out.rng_tensors)
    return out


@torch.no_grad()
def copy_state(plan: Capture, own_copy: bool = True) -> RankState:
    """This rank's share of the training state in host memory. With `own_copy` the
    tensors are copies (an asynchronous save: training goes on once they are done);
    without, views of the training buffers where they already are on the host (a
    synchronous save writes them before training touches them again)."""
    out = RankState(tensors=dict(plan.rng_tensors), rng=plan.rng)
    for sl, mine in plan.slices:
        held = {WEIGHTS: sl.param, MASTER: sl.master, EXP_AVG: sl.exp_avg,
                EXP_AVG_SQ: sl.exp_avg_sq}
        # One copy per slice and state (a few large copies, not one per parameter).
        copies = {state: t.to("cpu", copy=own_copy) for state, t in held.items() if t is not None}
        for pc in mine:
            info = pc.entry.info
            region = Region.of(info, pc.start, pc.stop)
            offset = pc.buf_start - sl.lo
            keys = {}
            for state, copy in copies.items():
                key = piece_key(info.name, state, region)
                out.tensors[key] = copy[offset:offset + region.numel]
                keys[state] = key
            out.pieces.append(PieceState(info.name, region, keys))
            out.shapes[info.name] = list(info.global_shape)
    return out


def capture(pm, own_copy: bool = True) -> RankState:
    """Both parts of a save's copy, here and now."""
    return copy_state(plan_capture(pm), own_copy)


def _module_generators(module: nn.Module, device: torch.device) -> dict[str, torch.Generator]:
    gens: dict[str, torch.Generator] = {}
    for m in module.modules():
        own = getattr(m, "checkpointed_generators", None)
        if own is not None:
            gens.update(own(device))
    return gens


def _capture_rng(module: nn.Module, device: torch.device, tensors: dict) -> dict:
    tensors[RNG_PREFIX + "torch"] = torch.get_rng_state()
    if device.type == "cuda":
        tensors[RNG_PREFIX + "cuda"] = torch.cuda.get_rng_state(device)
    for name, gen in _module_generators(module, device).items():
        tensors[RNG_PREFIX + name] = gen.get_state()
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors[RNG_PREFIX + "numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    return {"python": [version, list(state), gauss],
            "numpy": [kind, int(pos), int(has_gauss), float(cached)]}


def restore_rng(module: nn.Module, device: torch.device, rng: dict,
                read: callable) -> None:
    """Put the random streams back; `read(key)` gives a saved tensor of this rank."""
    torch.set_rng_state(read(RNG_PREFIX + "torch").clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(read(RNG_PREFIX + "cuda").clone(), device)
    for name, gen in _module_generators(module, device).items():
        gen.set_state(read(RNG_PREFIX + name).clone())
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    kind, pos, has_gauss, cached = rng["numpy"]
    keys = read(RNG_PREFIX + "numpy").numpy().astype(np.uint32)
    np.random.set_state((kind, keys, pos, has_gauss, cached))


def holds_every_stream(module: nn.Module, device: torch.device, saved_keys) -> bool:
    """Whether a rank's file holds every module generator this run draws from. With the
    same degrees it may not: sequence parallelism switched off on resume adds the
    replicated dropout stream, which the saved run never had; fresh streams then."""
    return all(RNG_PREFIX + name in saved_keys for name in _module_generators(module, device))


def reseed_rng(module: nn.Module, device: torch.device, seed: int, rank: int,
               step: int) -> None:
    """A different layout cannot take the saved streams (rank r no longer plays the
    same part): start fresh streams that depend on the step, so a resumed run does not
    repeat the masks of its first steps."""
    base = (seed * 1_000_003 + step) * 4099 + rank
    torch.manual_seed(base)
    for i, gen in enumerate(_module_generators(module, device).values()):
        gen.manual_seed(gen.initial_seed() ^ (step * 0x9E3779B1 + i))
