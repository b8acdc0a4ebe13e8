"""Saving checkpoints: a copy on the training thread, the writing on a background one.

    writer = CheckpointWriter(root, rank, world, keep_last=3, async_save=True)
    writer.save(step, pm, manifest_fields)   # returns once the state is copied
    ...
    writer.wait()                            # before exit, or before reading it back

Each save: every rank copies its share to host memory (`capture`: the only pause of
training), then, on the writer thread, writes its own safetensors file into
`step-N.<token>.partial/` and fsyncs it; the ranks hand their file records to rank 0
over a gloo group of their own (collectives on the training groups never wait for a
save), and rank 0 writes the manifest, fsyncs, renames the folder to `step-N`, points
`latest` at it and prunes old checkpoints. A failure anywhere (a full disk, a killed
process) leaves at most a `.partial` folder, which nothing ever reads and the next run
removes; the previous checkpoints are never touched. A second save waits for the first.
"""

from __future__ import annotations

import datetime
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from partita.checkpoint.files import record_to_json, write_file
from partita.checkpoint.manifest import (
    PARTIAL,
    fsync_dir,
    model_fields,
    prune,
    remove_partials,
    step_dir_name,
    write_latest,
    write_manifest,
)
from partita.checkpoint.state import RankState, copy_state, plan_capture


@dataclass
class SaveReport:
    step: int
    folder: Path | None  # None: the save failed
    copy_s: float  # the copy to host memory (beside training when asynchronous)
    total_s: float  # from the start of the copy to the checkpoint being complete
    nbytes: int  # this rank's file
    error: str = ""


class CheckpointWriter:
    """Writes this rank's part of each checkpoint; rank 0 also completes them."""

    def __init__(self, root: Path, rank: int, world: int, keep_last: int = 0,
                 async_save: bool = True, timeout_s: float = 600.0,
                 protect: Path | None = None,
                 before_write: Callable[[int], None] | None = None) -> None:
        self.root, self.rank, self.world = Path(root), rank, world
        self.keep_last, self.async_save, self.protect = keep_last, async_save, protect
        self.before_write = before_write  # fault injection: called on the writer thread
        # Metadata goes over a gloo group of its own, so that the writer thread never
        # shares a group (or, on a GPU, a stream) with training collectives.
        self.group = (dist.new_group(backend="gloo",
                                     timeout=datetime.timedelta(seconds=timeout_s))
                      if world > 1 else None)
        if rank == 0:  # before the broadcast below, which the other ranks wait for
            self.root.mkdir(parents=True, exist_ok=True)
            remove_partials(self.root)
        token = [uuid.uuid4().hex[:8] if rank == 0 else None]
        if world > 1:
            dist.broadcast_object_list(token, src=0, group=self.group)
        self.token = token[0]  # one per run attempt: this attempt's partial folders
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self.last: SaveReport | None = None
        self.failure = ""  # the first failed save's message, until cleared

    def save(self, step: int, pm, fields: dict) -> None:
        """Checkpoint after `step`. Synchronous: returns once written. Asynchronous:
        returns at once and copies the state on the writer thread; call `wait_for_copy`
        before anything changes the parameters or optimizer state (the next optimizer
        step). `fields`: what the manifest records beside the tensors."""
        self.wait()
        start = time.perf_counter()
        plan = plan_capture(pm)
        if not self.async_save:  # no copy: written before training touches it again
            self._write(step, copy_state(plan, own_copy=False), fields, start, 0.0)
            return
        self._copied.clear()
        self._thread = threading.Thread(target=self._copy_then_write, name="partita-checkpoint",
                                        args=(step, plan, fields, start), daemon=True)
        self._thread.start()

    def wait_for_copy(self) -> float:
        """Block until the save in flight holds its own copy of the state; seconds
        waited (what training paused for, beside the copy's share of the cores)."""
        if self._thread is None or self._copied.is_set():
            return 0.0
        start = time.perf_counter()
        self._copied.wait()
        return time.perf_counter() - start

    def _copy_then_write(self, step: int, plan, fields: dict, start: float) -> None:
        state, error = None, ""
        try:
            state = copy_state(plan, own_copy=True)
        except Exception as exc:  # noqa: BLE001 - reported like a failed write
            error = f"rank {self.rank} could not copy its state: {exc}"
        finally:
            copy_s = time.perf_counter() - start
            self._copied.set()
        self._write(step, state, fields, start, copy_s, error)

    def wait(self) -> SaveReport | None:
        """Wait for the save in flight; the report of the last save."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self.last

    def _write(self, step: int, state: RankState | None, fields: dict, start: float,
               copy_s: float, error: str = "") -> None:
        tmp = self.root / f"{step_dir_name(step)}.{self.token}{PARTIAL}"
        record = None
        state = state if state is not None else RankState()
        try:
            if not error:  # (an error here: the copy failed; report it like a write)
                if self.before_write is not None:
                    self.before_write(step)
                tmp.mkdir(parents=True, exist_ok=True)
                name = f"rank-{self.rank:05d}-of-{self.world:05d}.safetensors"
                record = write_file(tmp / name, state.tensors, {"format": "partita-checkpoint"})
        except OSError as exc:
            error = f"rank {self.rank} could not write {tmp}: {exc.strerror or exc}"
        except Exception as exc:  # noqa: BLE001 - every rank must reach the gather below
            error = f"rank {self.rank} failed writing {tmp}: {type(exc).__name__}: {exc}"
        mine = {"rank": self.rank, "error": error, "rng": state.rng, "shapes": state.shapes,
                "pieces": [p.to_json() for p in state.pieces],
                "file": record_to_json(record) if record is not None else None}
        try:
            error = self._agree_on_outcome(step, tmp, mine, fields)
        except Exception as exc:  # noqa: BLE001 - a peer died mid-save: report, don't raise
            error = f"the ranks lost each other while saving step {step}: {exc}"
        if error and not self.failure:
            self.failure = error
        nbytes = record.size if record is not None else 0
        self.last = SaveReport(step, None if error else self.root / step_dir_name(step),
                               copy_s, time.perf_counter() - start, nbytes, error)

    def _agree_on_outcome(self, step: int, tmp: Path, mine: dict, fields: dict) -> str:
        """Hand this rank's record to rank 0, which completes the checkpoint; every rank
        learns the outcome ("" when the checkpoint exists)."""
        parts = [mine]
        if self.group is not None:
            parts = [None] * self.world if self.rank == 0 else None
            dist.gather_object(mine, parts, dst=0, group=self.group)
        error = mine["error"]
        if self.rank == 0:
            _, error = self._complete(step, tmp, parts, fields)
        outcome = [error]
        if self.group is not None:
            dist.broadcast_object_list(outcome, src=0, group=self.group)
        return outcome[0]

    def _complete(self, step: int, tmp: Path, parts: list[dict],
                  fields: dict) -> tuple[Path | None, str]:
        errors = [p["error"] for p in parts if p["error"]]
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
            return None, errors[0]
        shapes: dict[str, list[int]] = {}
        files, pieces = [], []
        for index, part in enumerate(parts):
            shapes.update(part["shapes"])
            files.append(dict(part["file"], rank=part["rank"], rng=part["rng"]))
            pieces.extend(dict(p, file=index) for p in part["pieces"])
        manifest = dict(fields, step=step, world_size=self.world,
                        version=version_for(pieces),
                        created=datetime.datetime.now(datetime.UTC).isoformat(),
                        torch_version=torch.__version__,
                        tensors={n: {"shape": s} for n, s in sorted(shapes.items())},
                        files=files, pieces=pieces)
        final = self.root / step_dir_name(step)
        try:
            write_manifest(tmp, manifest)
            if final.exists():  # the same step written again (a rerun): replace it
                old = final.with_name(final.name + f".old{PARTIAL}")
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(final)
            fsync_dir(self.root)
            write_latest(self.root, final.name)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            return None, f"completing {final} failed: {exc.strerror or exc}"
        prune(self.root, self.keep_last, self.protect)
        return final, ""


def version_for(pieces: list[dict]) -> int:
    """The format version a manifest with these pieces needs: 2 when a piece is cut
    along more than one dimension (a reader of version 1 would misplace it), else 1, so
    that other checkpoints stay readable by older partita."""
    return 2 if any(p.get("more") for p in pieces) else 1


def manifest_fields(pm, training: dict, config: str = "", layout=None) -> dict:
    """What a manifest records beside the tensors: format, versions, layout (`layout`,
    a partita.layout.Layout, else the mesh's degrees), model, optimizer, precision,
    loss scaler, the run's own `training` fields (sampler position, counters) and the
    resolved run configuration (`config`, its TOML text)."""
    import dataclasses

    from partita import __version__
    from partita.checkpoint.manifest import FORMAT
    from partita.layout import DEGREES

    dp, dims = pm.dp, pm.mesh.dims
    layout = dataclasses.asdict(layout) if layout is not None else {}
    layout.update({k: getattr(dims, k) for k in DEGREES})
    slices = dp.owned_slices()
    param_dtype = slices[0].param.dtype if slices else torch.float32
    master = next((s.master.dtype for s in slices if s.master is not None), param_dtype)
    optim = dp.optim
    return {
        "format": FORMAT, "partita_version": __version__,
        "layout": layout, "model": model_fields(pm.model_cfg),
        "optimizer": {"name": "adamw", "steps": dp.step_count, "betas": list(optim.betas),
                      "eps": optim.eps, "weight_decay": optim.weight_decay},
        "precision": {"param_dtype": str(param_dtype), "master_dtype": str(master)},
        "scaler": dp.scaler.state_dict(), "training": training, "config": config,
    }
