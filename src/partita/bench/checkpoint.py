"""Checkpoints: partita's against torch.distributed.checkpoint (DCP) on FSDP2, one run.

Both sides hold the same model (partita's Transformer, whose initial weights are drawn
by global name, so the two start equal) on the same ranks (gloo, one thread per rank):
partita under ZeRO-3, the peer under FSDP2 (`fully_shard` per block and at the root),
each with AdamW whose moments one training step has filled. Per world size, largest
first, after a warm-up round, rounds alternate the two sides (which goes first
alternates too) and time:

  save     partita `CheckpointWriter(async_save=False).save`; DCP `get_state_dict` and
           `dcp.save` (its FileSystemWriter defaults: a file per rank, fsynced). Each
           save writes a fresh folder; the previous round's is deleted untimed.
  load     partita `load_checkpoint`; DCP `get_state_dict`, `dcp.load`, `set_state_dict`.
  reshard  the same loads of the first (largest) world's checkpoints, e.g. 4 -> 2.

A time is the slowest rank's between barriers; a row's ratio is the median of the
per-round partita/DCP ratios with its 99% interval (`partita.bench.paired`; below 8
rounds, as in --quick's 2, the range of the rounds, which the lines above the tables
then say). Page cache:
`warm` (default) reads every file of a checkpoint once just before it is loaded; `cold`
drops the checkpoint's pages instead (posix_fadvise DONTNEED; the files are fsynced, so
their pages are clean and go), so that loads read the disk. Both sides alike.

Per world also: the bytes of each checkpoint folder against the model-state formula
(fp32 weights and two Adam moments, 12 bytes per parameter; 16 with a master copy), and
partita's asynchronous save: in every round, right after partita's synchronous save, an
asynchronous one followed by what training does next (the forward and backward of one
batch, while the writer thread copies the state); the stall is the time training
waited: `save` returning plus `wait_for_copy` before the optimizer step. The save is
waited for before the round goes on; its stall over the synchronous save of the same
round, median and interval as above. After the loads of a world's own
checkpoint, every rank checks that each side restored exactly the state it saved (a
CRC-32 of every tensor before and after).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from partita.arg_types import count, several
from partita.bench import paired
from partita.local_world import run_distributed

Timer = Callable[[int], float]


@dataclass(frozen=True)
class Setup:
    dim: int = 768
    layers: int = 12
    heads: int = 12
    vocab: int = 32000
    warmup: int = 1  # untimed rounds of every pair first
    rounds: int = 5
    max_rounds: int = 10  # a pair whose interval spans 1.0 doubles its rounds up to this
    cache: str = "warm"  # "cold": loads read the disk


QUICK = Setup(dim=64, layers=2, heads=4, vocab=256, rounds=2, max_rounds=2)


def _config(setup: Setup, world: int):
    from partita.config import load_config

    return load_config(None, [
        f"--model.dim={setup.dim}", f"--model.n_layers={setup.layers}",
        f"--model.n_heads={setup.heads}", f"--model.n_kv_heads={setup.heads}",
        f"--model.vocab_size={setup.vocab}", "--model.max_seq_len=16",
        "--data.seq_len=16", "--parallel.zero_stage=3", f"--train.global_batch={world}",
        "--train.dtype=float32"])


def _tokens(setup: Setup, rank: int, world: int) -> torch.Tensor:
    """This rank's share of one global batch, the same at every world size."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, setup.vocab, (4, 17), generator=gen)
    return tokens.repeat(world, 1).chunk(world)[rank]


def _partita_model(setup: Setup, rank: int, world: int, tokens: torch.Tensor):
    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model, dims_from_config

    cfg = _config(setup, world)
    pm = build_parallel_model(cfg, Mesh(dims_from_config(cfg, world), rank, world),
                              torch.device("cpu"))
    pm.runner.train(tokens[:, :-1], tokens[:, 1:], 1)
    pm.dp.finish_grad_sync()
    pm.dp.step(1e-4)
    pm.dp.zero_grad()
    return pm


def _fsdp2_model(setup: Setup, world: int, tokens: torch.Tensor):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from partita.models.transformer import build_model

    model = build_model(_config(setup, world).model_config())
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in _files(folder))


def _set_cache(folder: Path, cache: str) -> None:
    """Bring a checkpoint's pages into the page cache (warm) or drop them (cold)."""
    for path in _files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            if cache == "cold":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.read(fd, 16 << 20):
                    pass
        finally:
            os.close(fd)


class Sides:
    """One rank's two sides: what each saves, where, and how it loads."""

    def __init__(self, setup: Setup, rank: int, world: int, root: Path) -> None:
        from partita.checkpoint import CheckpointWriter

        tokens = _tokens(setup, rank, world)
        self.tokens = tokens
        self.pm = _partita_model(setup, rank, world, tokens)
        self.model, self.opt = _fsdp2_model(setup, world, tokens)
        self.rank, self.world, self.setup = rank, world, setup
        self.dirs = {"partita": root / f"partita-w{world}", "dcp": root / f"dcp-w{world}",
                     "async": root / f"partita-async-w{world}"}
        self.writer = CheckpointWriter(self.dirs["partita"], rank, world, async_save=False)
        self.async_writer = CheckpointWriter(self.dirs["async"], rank, world, keep_last=1,
                                             async_save=True)
        self.latest: dict[str, Path] = {}
        self.saves = 0

    # saving -----------------------------------------------------------------------

    def save_partita(self) -> float:
        from partita.checkpoint import manifest_fields

        step = self._next()
        t0 = time.perf_counter()
        self.writer.save(step, self.pm, manifest_fields(self.pm, training={}))
        took = time.perf_counter() - t0
        if self.writer.failure:
            raise RuntimeError(self.writer.failure)
        self._keep_only(self.writer.last.folder, "partita")
        return took

    def save_dcp(self) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        folder = self.dirs["dcp"] / f"step-{self._next():08d}"
        t0 = time.perf_counter()
        msd, osd = get_state_dict(self.model, self.opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
        took = time.perf_counter() - t0
        self._keep_only(folder, "dcp")
        return took

    def save_async(self) -> tuple[float, float]:
        """Seconds `save` blocked, seconds until the checkpoint was complete."""
        from partita.checkpoint import manifest_fields

        step = self._next()
        t0 = time.perf_counter()
        self.async_writer.save(step, self.pm, manifest_fields(self.pm, training={}))
        stall = time.perf_counter() - t0
        # What training does meanwhile: the next step's forward and backward; the
        # optimizer step would then wait for the copy.
        self.pm.runner.train(self.tokens[:, :-1], self.tokens[:, 1:], 1)
        self.pm.dp.finish_grad_sync()
        stall += self.async_writer.wait_for_copy()
        self.pm.dp.zero_grad()
        report = self.async_writer.wait()
        if self.async_writer.failure:
            raise RuntimeError(self.async_writer.failure)
        return stall, report.total_s

    def _next(self) -> int:
        """A new step number: every save writes a folder of its own."""
        self.saves += 1
        return self.saves

    def _keep_only(self, folder: Path, side: str) -> None:
        """Untimed: delete the side's previous checkpoint once every rank is done."""
        dist.barrier()
        old = self.latest.get(side)
        if self.rank == 0 and old is not None and old != folder:
            shutil.rmtree(old)
        self.latest[side] = folder

    # loading ----------------------------------------------------------------------

    def load_partita(self, folder: Path) -> float:
        from partita.checkpoint import load_checkpoint

        self._prepare(folder)
        t0 = time.perf_counter()
        load_checkpoint(self.pm, folder)
        return time.perf_counter() - t0

    def load_dcp(self, folder: Path) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        self._prepare(folder)
        t0 = time.perf_counter()
        msd, osd = get_state_dict(self.model, self.opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return time.perf_counter() - t0

    def _prepare(self, folder: Path) -> None:
        if self.rank == 0:
            _set_cache(folder, self.setup.cache)
        dist.barrier()

    # checks -------------------------------------------------------------------------

    def _partita_views(self) -> list[torch.Tensor]:
        """Every piece of state partita owns on this rank (not the flat padding, which
        no checkpoint holds)."""
        out = []
        for sl in self.pm.dp.owned_slices():
            held = [t for t in (sl.param, sl.master, sl.exp_avg, sl.exp_avg_sq)
                    if t is not None]
            for pc in sl.pieces:
                offset = pc.buf_start - sl.lo
                out += [t[offset:offset + pc.stop - pc.start] for t in held]
        return out

    def _dcp_views(self) -> list[torch.Tensor]:
        out = [p.to_local() for p in self.model.parameters()]
        for state in self.opt.state.values():
            out += [v.to_local() for k, v in sorted(state.items()) if k != "step"]
        return out

    def fingerprint(self) -> dict[str, list[int]]:
        """Both sides' training state on this rank, as a CRC-32 per tensor (copies of
        it would double the benchmark's memory)."""
        def crcs(tensors: list[torch.Tensor]) -> list[int]:
            return [zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy())
                    for t in tensors]
        return {"partita": crcs(self._partita_views()), "dcp": crcs(self._dcp_views())}

    @torch.no_grad()
    def scramble(self) -> None:
        """Overwrite both sides' state, so that a load that restores nothing fails the
        check after it."""
        for t in self._partita_views() + self._dcp_views():
            t.fill_(0.5)


def _timer(sides: tuple[Callable[[], float], Callable[[], float]]) -> Timer:
    def time_side(k: int) -> float:
        dist.barrier()
        return paired.slowest_rank(sides[k]())
    return time_side


def _pair(time_side: Timer, setup: Setup) -> tuple[list[float], list[float]]:
    for _ in range(setup.warmup):
        time_side(0)
        time_side(1)
    return paired.paired_rounds(time_side, setup.rounds, setup.max_rounds, 1.0)


def _worker(rank: int, world: int, setup: Setup, root: str,
            reshard: tuple[int, str, str] | None) -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)
    sides = Sides(setup, rank, world, Path(root))
    out: dict = {"world": world, "rows": []}

    def row(what: str, times: tuple[list[float], list[float]]) -> None:
        out["rows"].append({"what": what, "partita": statistics.median(times[0]),
                            "dcp": statistics.median(times[1]),
                            "estimate": paired.estimate_times(times)})

    stalls: list[tuple[float, float]] = []

    def save_partita() -> float:
        # Each synchronous save is followed by an asynchronous one (waited for before
        # the round goes on): its stall is paired with the save of the same round.
        took = sides.save_partita()
        stall, total = sides.save_async()
        stalls.append((paired.slowest_rank(stall), paired.slowest_rank(total)))
        return took

    saves = _pair(_timer((save_partita, sides.save_dcp)), setup)
    row("save", saves)
    expected = sides.fingerprint()
    sides.scramble()
    ours, theirs = sides.latest["partita"], sides.latest["dcp"]
    row("load", _pair(_timer((lambda: sides.load_partita(ours),
                              lambda: sides.load_dcp(theirs))), setup))
    got = sides.fingerprint()
    out["restored"] = {k: paired.slowest_rank(float(expected[k] != got[k])) == 0.0
                       for k in expected}
    if reshard is not None:
        src, ours, theirs = reshard[0], Path(reshard[1]), Path(reshard[2])
        row(f"load {src}->{world}", _pair(_timer((lambda: sides.load_partita(ours),
                                                  lambda: sides.load_dcp(theirs))), setup))
    timed = stalls[setup.warmup:]
    out["async"] = {"stall": statistics.median(s for s, _ in timed),
                    "total": statistics.median(t for _, t in timed),
                    "ratio": paired.estimate([s / t for (s, _), t in zip(timed, saves[0],
                                                                         strict=True)])}
    if rank == 0:
        out["bytes"] = {k: folder_bytes(sides.latest[k]) for k in ("partita", "dcp")}
        out["folders"] = {k: str(sides.latest[k]) for k in ("partita", "dcp")}
    return out


def parameter_count(setup: Setup) -> int:
    from partita.models.transformer import build_model

    model = build_model(_config(setup, 1).model_config(), device="meta")
    return sum(p.numel() for p in model.parameters())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worlds", **several(count), default=[4, 2],
                        help="world sizes, run largest first; the later ones also load "
                             "the first one's checkpoints (default 4 2)")
    parser.add_argument("--dim", type=count, default=Setup.dim)
    parser.add_argument("--layers", type=count, default=Setup.layers)
    parser.add_argument("--heads", type=count, default=Setup.heads)
    parser.add_argument("--vocab", type=count, default=Setup.vocab)
    parser.add_argument("--rounds", type=count, default=Setup.rounds,
                        help="timed rounds per pair, at least (default 5)")
    parser.add_argument("--max-rounds", type=count, default=Setup.max_rounds,
                        help="rounds a pair whose interval spans 1.0 may double up to")
    parser.add_argument("--cache", choices=("warm", "cold"), default=Setup.cache,
                        help="page cache before each load (default warm)")
    parser.add_argument("--dir", default="",
                        help="where checkpoints are written (default: a temporary folder "
                             "under the current one, removed at the end)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and 2 rounds: checks that the benchmark runs")


def setup_from(args: argparse.Namespace) -> Setup:
    if args.quick:
        return replace(QUICK, cache=args.cache)
    return Setup(dim=args.dim, layers=args.layers, heads=args.heads, vocab=args.vocab,
                 rounds=args.rounds, max_rounds=max(args.rounds, args.max_rounds),
                 cache=args.cache)


def describe(setup: Setup, params: int, formula: int, legend: str | None = None) -> list[str]:
    """The lines above the tables; `legend` (`paired.legend` of every interval in them)
    ends the second, so that a --quick run prints a fixed number of lines."""
    cache = ("warm: every file read once just before each load" if setup.cache == "warm"
             else "cold: the checkpoint's pages dropped before each load")
    return [
        f"checkpoint: partita Transformer, {params / 1e6:.1f}M parameters (dim {setup.dim}, "
        f"{setup.layers} layers, vocab {setup.vocab}, fp32), AdamW states from one step; "
        "partita ZeRO-3 vs DCP on FSDP2; gloo, 1 thread per rank",
        f"{setup.warmup} warm-up round, then interleaved rounds ({setup.rounds}, doubled "
        f"up to {setup.max_rounds} while the 99% interval spans 1.0); slowest rank, "
        f"median seconds; page cache {cache}" + (f"; {legend}" if legend else ""),
        f"model-state formula: {params:,} parameters x 12 bytes (fp32 weights + 2 Adam "
        f"moments; no master copy in fp32) = {formula:,} bytes",
    ]


TABLE_HEAD = (f"{'world':>5} {'what':>10} {'partita s':>10} {'dcp s':>8} {'ratio':>7} "
              f"{'interval':>13} {'rounds':>6}")
BYTES_HEAD = (f"{'world':>5} {'partita bytes':>15} {'vs formula':>10} {'dcp bytes':>15} "
              f"{'async stall s':>13} {'sync save s':>11} {'stall %':>7} "
              f"{'interval':>13} {'async total s':>13}")


def run(args: argparse.Namespace) -> int:
    setup = setup_from(args)
    worlds = sorted(set(args.worlds), reverse=True)
    params = parameter_count(setup)
    base = Path(args.dir) if args.dir else None
    root = base or Path(f"partita-bench-checkpoint-{os.getpid()}")
    root.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        reshard = None
        for world in worlds:
            out = run_distributed(_worker, world, args=(setup, str(root), reshard),
                                  timeout=7200)[0]
            failed = [k for k, ok in out["restored"].items() if not ok]
            if failed:
                raise RuntimeError(f"world {world}: {' and '.join(failed)} did not load "
                                   "back the state it saved")
            results.append(out)
            if reshard is None:
                reshard = (world, out["folders"]["partita"], out["folders"]["dcp"])
    finally:
        if base is None:
            shutil.rmtree(root, ignore_errors=True)
    print_report(setup, params, results)
    return 0


def print_report(setup: Setup, params: int, results: list[dict]) -> None:
    """The description, the two tables of the worlds' `_worker` results and the verdict
    line."""
    formula = 12 * params
    legend = paired.legend([r["estimate"] for out in results for r in out["rows"]]
                           + [out["async"]["ratio"] for out in results])
    for line in describe(setup, params, formula, legend):
        print(line)
    print(TABLE_HEAD)
    worst = 0.0
    for out in results:
        for r in out["rows"]:
            est = r["estimate"]
            worst = max(worst, est.median)
            print(f"{out['world']:>5} {r['what']:>10} {r['partita']:>10.3f} {r['dcp']:>8.3f} "
                  f"{est.median:>7.3f} {est.span:>13} {est.rounds:>6}")
    print(BYTES_HEAD)
    worst_stall = 0.0
    for out in results:
        b, a = out["bytes"], out["async"]
        sync = next(r["partita"] for r in out["rows"] if r["what"] == "save")
        est = a["ratio"]
        worst_stall = max(worst_stall, est.median)
        print(f"{out['world']:>5} {b['partita']:>15,} {b['partita'] / formula - 1:>+10.2%} "
              f"{b['dcp']:>15,} {a['stall']:>13.3f} {sync:>11.3f} {est.median:>7.1%} "
              f"{f'{est.low:.1%}-{est.high:.1%}':>13} {a['total']:>13.3f}")
    print(f"checkpoint: worst partita/dcp time ratio {worst:.3f}; "
          f"async stall {worst_stall * 100:.1f}% of sync save")
