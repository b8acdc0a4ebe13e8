"""The benchmarks' pair harness (`partita.bench.dp.time_pairs`): each pair's row is
reported as soon as the pair is done, and its runners are gone by then, so a long run
keeps the rows before a crash and holds one pair's memory at a time."""

from __future__ import annotations

import importlib.util
import weakref

import pytest

from partita.bench import dp as harness
from partita.bench import zero
from partita.testing import run_distributed

SETUP = harness.Setup(batch=1, seq=16, warmup=1, rounds=1, max_rounds=1, steps=1)


class _Tracker:
    """`build` for time_pairs that keeps a weak reference to each runner's engine (the
    object holding model, buffers and optimizer) and logs builds and reports in order."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.engines: list[tuple[str, weakref.ref]] = []

    def build(self, name, model, mesh):
        step = zero.build_step(name, model, mesh)
        self.events.append(f"build {name}")
        if hasattr(step, "engine"):
            self.engines.append((name, weakref.ref(step.engine)))
        else:  # a peer: the model (a DeepSpeed engine wraps it, and holds on to it)
            self.engines.append((name, weakref.ref(model)))
        return step

    def report(self, row: dict) -> None:
        alive = [name for name, ref in self.engines if ref() is not None]
        self.events.append(f"report {row['ours']} / {row['peer']}, alive: {alive}")


def _worker(rank: int, world: int, pairs: list[tuple[str, str]]) -> list[str]:
    zero._BATCH[0] = SETUP.batch
    tracker = _Tracker()
    harness.time_pairs(rank, world, SETUP, pairs, tracker.build, None, tracker.report)
    return tracker.events


def test_each_pair_is_reported_when_done_and_its_runners_are_freed_first():
    # Stage 3's gather hooks and stage 1's gradient hooks are what kept engines alive.
    pairs = [("partita stage 3", "partita stage 1"), ("partita stage 0", "torch DDP")]
    events = run_distributed(_worker, 1, args=(pairs,))[0]
    assert events == ["build partita stage 3", "build partita stage 1",
                      "report partita stage 3 / partita stage 1, alive: []",
                      "build partita stage 0", "build torch DDP",
                      "report partita stage 0 / torch DDP, alive: []"]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (an optional extra)")
def test_a_deepspeed_engine_is_freed_after_its_pair():
    # ZeRO-2 (ZeRO-3's engines outlive their pair: see zero._release_deepspeed).
    events = run_distributed(_worker, 1, args=([("partita stage 2", "DeepSpeed ZeRO 2")],),
                             timeout=600)[0]
    assert events[-1] == "report partita stage 2 / DeepSpeed ZeRO 2, alive: []", events


def _gpu_compile_pairs(rank: int, world: int) -> tuple[list[dict], str]:
    from partita.bench import gpu

    setup = harness.Setup(batch=1, seq=16, warmup=1, rounds=1, max_rounds=1, steps=1)
    rows, _, kernels = gpu._worker(rank, world, setup, gpu.COMPILE_PAIRS,
                                   "partita stage 0 model", gpu._print_row)
    return rows, kernels


def test_the_gpu_bench_compile_runners_and_profile_run_on_cpu():
    """`partita bench gpu --compile --profile ...` (the device script's compile part) on
    CPU: every compile runner builds and steps in bf16 next to its eager stage, and the
    profile lists the runner's kernels, the matmuls among them. A GPU run is then only
    the device."""
    from partita.bench import gpu

    rows, kernels = run_distributed(_gpu_compile_pairs, 1, timeout=900)[0]
    assert [(r["ours"], r["peer"]) for r in rows] == gpu.COMPILE_PAIRS
    for r in rows:
        assert 0 < r["estimate"].median < 10, r
        assert r["first_ours"] > 0 and r["first_peer"] > 0, r  # compile time is on record
    assert "aten::mm" in kernels and "Self CPU" in kernels, kernels
