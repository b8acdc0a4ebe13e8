"""Disk offload (`parallel.offload=optimizer+disk`, partita.memory.disk).

Parity: float64, dp=2 ZeRO-1 and ZeRO-3 against one process within 1e-10, through
sub-groups far smaller than a bucket. The budget: a model whose optimizer states are
more than 4x the budget trains with the engine's host buffers within the budget and
losses equal to the in-memory run's. The order of reads, updates and writes; the
files' two generations; and bad input: a missing, unwritable or too small directory
and a budget below one sub-group fail before training, a read that fails mid-run names
the file and leaves the previous state whole.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from partita.errors import PartitaError
from partita.memory.disk import ALIGN, MIN_SUBGROUP, SETS, DiskOptimizer, _supports_direct
from partita.mesh import Mesh
from partita.optim import AdamWConfig
from partita.parallelize import build_parallel_model, check_layout
from partita.testing import (
    FLOAT64_TOL,
    Case,
    check_layouts,
    parity_config,
    relative_error,
    train_layout,
)

STEPS = 3
BUDGET_GB = 0.0005  # 500 kB: 5208 float64 elements per sub-group


WIDER = dict(dim=64, vocab_size=256)  # 131k parameters: 3.1 MB of float64 states


def _cfg(directory: str, budget_gb: float = BUDGET_GB, model: dict | None = None,
         **parallel):
    parallel.setdefault("offload", "optimizer+disk")
    parallel.setdefault("bucket_mb", 0.01)
    return parity_config(model=model or {},
                         parallel=dict(offload_dir=directory,
                                       host_memory_budget_gb=budget_gb, **parallel))


def test_two_ranks_match_one_process(tmp_path: Path) -> None:
    cases = [Case("dp2-zero1-disk", _cfg(str(tmp_path), dp=2, zero_stage=1), params=True),
             Case("dp2-zero3-params-disk", _cfg(str(tmp_path), dp=2, zero_stage=3,
                                                offload="optimizer+params+disk"), params=True)]
    check_layouts(cases, 2, STEPS, timeout=200)


@pytest.mark.parametrize("stage,offload", [(1, "optimizer+disk"),
                                           (3, "optimizer+params+disk")])
def test_states_four_times_the_budget_train_as_in_memory(tmp_path: Path, stage: int,
                                                         offload: str) -> None:
    """Optimizer states (master weights and two moments, float64) over 4x the budget:
    the engine's host buffers stay within it, and the losses are the in-memory run's.
    With the parameters on disk too, no parameter is resident between gathers."""
    cfg = _cfg(str(tmp_path), model=WIDER, zero_stage=stage, offload=offload, bucket_mb=1.0)
    disk = train_layout(0, 1, cfg, STEPS)
    memory = train_layout(0, 1, parity_config(model=WIDER, parallel=dict(
        bucket_mb=1.0, zero_stage=stage)), STEPS)
    # The float64 parity tolerance, not equality: the two runs lay the parameters out in
    # different flat buffers (ZeRO-3 units against stage 0's buckets at one rank), and on
    # some CPUs a matmul's last bit depends on where its operand lies (an AMD EPYC gave
    # 5.458414859095495 against 5.4584148590954955 at the second step).
    assert relative_error(disk["losses"] + [disk["val"]],
                          memory["losses"] + [memory["val"]]) <= FLOAT64_TOL
    ledger = disk["ledger"]
    params = memory["ledger"]["parameters"] if "+params" in offload else 0
    assert ledger["parameters"] == memory["ledger"]["parameters"] - params
    # On disk, per generation: a float64 master copy and both moments of every element
    # (and the parameter shards, one file rewritten in place).
    states = (ledger["disk_bytes"] - params) // 2
    assert states == 3 * memory["ledger"]["optimizer_states"] // 2
    budget = BUDGET_GB * 1e9
    assert ledger["master_weights"] == ledger["optimizer_states"] == 0
    assert states > 4 * budget
    assert ledger["host_model_states"] == ledger["host_optimizer_buffers"] <= budget


@pytest.mark.parametrize("stage,offload", [(1, "optimizer+disk"),
                                           (3, "optimizer+params+disk")])
def test_a_checkpoint_resumes_the_state_on_disk(tmp_path: Path, stage: int,
                                                offload: str) -> None:
    """A checkpoint saves the states (and parameter shards) from their files and a
    resumed run writes them back: its losses are those of the run that went on."""
    states, ckpt = tmp_path / "states", str(tmp_path / "ckpt")
    states.mkdir()
    cfg = _cfg(str(states), zero_stage=stage, offload=offload)
    whole = train_layout(0, 1, cfg, STEPS, params=True)
    train_layout(0, 1, cfg, STEPS - 1, save_to=ckpt)
    resumed = train_layout(0, 1, cfg, STEPS, resume_from=ckpt, params=True)
    assert resumed["losses"] == whole["losses"][STEPS - 1:]
    assert resumed["val"] == whole["val"]
    for name, (_, value) in whole["params"].items():
        assert torch.equal(resumed["params"][name][1], value), name


def _disk(tmp_path: Path, sizes: list[int], budget: int,
          direct: bool | None = None) -> tuple[DiskOptimizer, list]:
    params = [torch.randn(n, dtype=torch.float64) for n in sizes]
    decay = [[(0, n // 2)] for n in sizes]
    disk = DiskOptimizer.create(params, [torch.float64] * len(sizes), decay, torch.float64,
                                str(tmp_path), budget, "t", direct=direct)
    return disk, params


@pytest.mark.parametrize("direct", [True, False])
def test_sub_groups_are_read_updated_written_in_order(tmp_path: Path, direct: bool) -> None:
    """Full sub-groups through O_DIRECT (where the file system takes it) and the
    shorter last one buffered; or all of them buffered: the same numbers."""
    if direct and not _supports_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    per_set = 3 * 8 * MIN_SUBGROUP  # three float64 states (gradients read in place)
    disk, params = _disk(tmp_path, [3 * MIN_SUBGROUP, MIN_SUBGROUP + 5], SETS * per_set + ALIGN,
                         direct)
    assert disk.subgroup == MIN_SUBGROUP and disk.direct == direct
    grads = [torch.randn_like(p) for p in params]
    expect = [p.clone() for p in params]
    disk.step([1, 0], params, grads, 1, 1e-2, AdamWConfig())
    tasks = [(1, 0), (1, MIN_SUBGROUP), (0, 0), (0, MIN_SUBGROUP), (0, 2 * MIN_SUBGROUP)]
    assert disk.copies == [(k, b, a) for b, a in tasks for k in ("read", "adam", "write")]
    assert disk.generation == 1
    # The same update as AdamW over the whole slice in memory.
    from partita.optim import adamw_, adamw_scratch

    for b, p in enumerate(expect):
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        adamw_(p, grads[b], m, v, 1, 1e-2, AdamWConfig(), [(0, p.numel() // 2)],
               adamw_scratch(0, p.dtype, p.device))
        assert torch.equal(params[b], p)
        assert torch.equal(disk.read_states(b)["exp_avg"], m)


def test_a_failed_read_names_the_file_and_keeps_the_last_state(tmp_path: Path) -> None:
    disk, params = _disk(tmp_path, [2 * MIN_SUBGROUP], SETS * 3 * 8 * MIN_SUBGROUP + ALIGN)
    grads = [torch.randn_like(params[0])]
    disk.step([0], params, grads, 1, 1e-2, AdamWConfig())
    kept = disk.read_states(0)
    current = disk.paths[0][disk.generation]
    saved = current.read_bytes()
    os.truncate(current, 8 * MIN_SUBGROUP)  # the moments are gone from the file
    with pytest.raises(PartitaError, match=str(current)):
        disk.step([0], params, grads, 2, 1e-2, AdamWConfig())
    assert disk.generation == 1  # not advanced: the failed step is not current
    current.write_bytes(saved)  # (a restored file: the state read back is the last one)
    assert all(torch.equal(disk.read_states(0)[k], kept[k]) for k in kept)


def test_bad_directory_or_budget_fails_before_training(tmp_path: Path, monkeypatch) -> None:
    def check(cfg) -> None:
        check_layout(cfg, cfg.model_config(), cfg.layout(1), 1)

    check(_cfg(str(tmp_path / "missing" / "nested")))  # created, like the run's folders
    assert (tmp_path / "missing" / "nested").is_dir()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(PartitaError, match="is a file, not a folder"):
        check(_cfg(str(tmp_path / "a-file")))
    with pytest.raises(PartitaError, match="parallel.offload_dir, which is not set"):
        check(_cfg(""))
    with pytest.raises(PartitaError, match="smaller than one disk-offload sub-group"):
        check(_cfg(str(tmp_path), budget_gb=1e-6))
    free = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: free._replace(free=1000))
    with pytest.raises(PartitaError, match="has 1,000 bytes free, but disk offload needs"):
        check(_cfg(str(tmp_path)))
    monkeypatch.undo()
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(PartitaError, match="not writable"):
            check(_cfg(str(locked)))
    check(_cfg(str(tmp_path)))  # a good one passes
    with pytest.raises(PartitaError, match="sub-group"):  # the engine refuses it too
        build_parallel_model(_cfg(str(tmp_path), budget_gb=1e-6), Mesh(
            _cfg(str(tmp_path)).layout(1).degrees, 0, 1), torch.device("cpu"))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_buffers_stay_within_the_budget(tmp_path: Path, grad_dtype: torch.dtype) -> None:
    """Buffer sets and, for gradients of another dtype, the cast's scratch."""
    budget = 1_000_000
    params = [torch.zeros(300_000)]
    disk = DiskOptimizer.create(params, [grad_dtype], [[]], torch.float32, str(tmp_path),
                                budget, "b")
    assert disk.subgroup < params[0].numel()
    # Sub-groups are whole ALIGN-byte records: at most one granule of each set short.
    assert 0.95 * budget < disk.buffer_bytes() <= budget


# A fresh process per run, so that its peak resident set (VmHWM) is its own: a model
# of 2.5M float64 parameters, optimizer states (60 MB on disk per generation, 40 MB in
# memory without a separate master) over 4x a 12 MB budget. glibc's mmap threshold is
# fixed (large blocks mapped, and unmapped when freed) and the cycle collector off, so
# that the resident set follows live memory: left to adjust itself, glibc keeps freed
# blocks in a heap whose high-water mark then depends on the order of allocations
# (peaks of the same run moved by up to 13 MB between processes).
RSS_PROBE = """
import gc, json, sys, torch
gc.disable()  # no collection at a moment of its own choosing: the same peak every run
torch.set_num_threads(1)
from partita.testing import parity_config, train_layout
offload, directory = sys.argv[1], sys.argv[2]
parallel = dict(bucket_mb=8.0, zero_stage=1, offload=offload)
if offload != "none":
    parallel.update(offload_dir=directory, host_memory_budget_gb=float(sys.argv[3]))
cfg = parity_config(model=dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=8192),
                    parallel=parallel)
out = train_layout(0, 1, cfg, 2)
status = {line.split(":")[0]: int(line.split()[1]) * 1024
          for line in open("/proc/self/status") if line.split()[-1] == "kB"}
print(json.dumps(dict(peak=status["VmHWM"], file=status["RssFile"], anon=status["RssAnon"],
                      losses=out["losses"], ledger=out["ledger"])))
"""
RSS_BUDGET_GB = 0.012
# Beyond its buffers the disk engine holds its two I/O threads (stacks, per-thread
# malloc arenas): measured 0.4-0.6 MB; peaks of the same run agree within 0.2 MB.
RSS_NOISE = 2 << 20


def _peak_run(offload: str, directory: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, offload, str(directory),
                          str(RSS_BUDGET_GB)], capture_output=True, text=True, check=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1",
                                               MALLOC_MMAP_THRESHOLD_=str(128 << 10)))
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_measured_peak_resident_memory_stays_within_the_budget(tmp_path: Path) -> None:
    """Measured, not counted: the disk run's peak resident memory is at most the
    in-memory run's without its optimizer states (what is left: runtime, parameters,
    gradients, activations) plus the budget; the optimizer states are over 4x the
    budget, and the losses are the in-memory run's."""
    memory, disk = _peak_run("none", tmp_path), _peak_run("optimizer+disk", tmp_path)
    assert disk["losses"] == memory["losses"]
    budget = RSS_BUDGET_GB * 1e9
    states = memory["ledger"]["master_weights"] + memory["ledger"]["optimizer_states"]
    on_disk = disk["ledger"]["disk_bytes"] // 2  # one generation
    assert on_disk > 4 * budget and states > 3 * budget
    rest = memory["peak"] - states  # everything but the optimizer states
    assert disk["peak"] <= rest + budget + RSS_NOISE, (disk["peak"], rest, budget)
    # And the states really left memory: the disk run's peak is lower by about them.
    assert memory["peak"] - disk["peak"] >= states - budget - RSS_NOISE
