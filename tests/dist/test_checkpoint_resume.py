"""Checkpoints: exact resume in the same layout, and resharding into other layouts.

Exact resume: a run stopped after step K and resumed from its checkpoint in the same
layout continues with bitwise the same losses and parameters as an uninterrupted run
(float64 and float32, CPU). Reshard: a checkpoint written by one layout and loaded by
another continues like one process trained without interruption, float64 within 1e-10
relative (only the reduction order differs). The pairs below together change every
dimension: world size (4 -> 2, 2 -> 4, 8 -> 1), ZeRO stage (3 -> 0, 0 -> 3), tp
(2 -> 1, 1 -> 2), pp (pp 2 -> tp 2) and schedule (gpipe -> interleaved), plus precision
(float32 -> bfloat16 with fp32 master weights), and sequence parallelism switched off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from partita.checkpoint import CheckpointMismatch, load_checkpoint, read_manifest, resolve
from partita.checkpoint.manifest import write_manifest
from partita.checkpoint.export import full_tensors
from partita.mesh import Mesh
from partita.parallelize import build_parallel_model, dims_from_config
from partita.testing import (
    FLOAT64_TOL,
    Case,
    assert_parity,
    compare_to_reference,
    parity_config,
    reference,
    run_layouts,
    single_process,
    train_layout,
)
from tests.dist.pipeline_cases import pipeline_config

STEPS, STOP = 4, 2  # train STEPS; the interrupted run stops (and saves) after STOP

F32 = dict(train=dict(dtype="float32"))

# Layouts checked for exact resume at world 2 (name -> config). ZeRO-2 saves what ZeRO-1
# saves (gradients are not state), and 1F1B the state of GPipe (the schedule keeps none).
WORLD2 = {
    "dp2": parity_config(),
    "zero1": parity_config(parallel=dict(zero_stage=1)),
    "zero3": parity_config(parallel=dict(zero_stage=3)),
    "tp2-sp": parity_config(parallel=dict(tp=2, sequence_parallel=True)),
    "pp2-gpipe": pipeline_config(schedule="gpipe"),
    "pp2-interleaved": pipeline_config(schedule="interleaved-1f1b", virtual_stages=2),
    "pp2-zb": pipeline_config(schedule="zb-h1"),
    "zero3-fp32": parity_config(parallel=dict(zero_stage=3), **F32),
    "bf16-zero1": parity_config(parallel=dict(zero_stage=1),
                                precision=dict(param_dtype="bfloat16"), **F32),
    "zero3-host-offload": parity_config(parallel=dict(zero_stage=3, offload="optimizer+params")),
}
THREE_D = pipeline_config(dp=2, tp=2, zero_stage=1, sequence_parallel=True,
                          schedule="1f1b", microbatches=2)

# Reshard pairs: (saved by, its world) -> (loaded into, its world).
RESHARD = {
    "world 4->2 (zero1)": ("dp4-zero1", 4, parity_config(parallel=dict(zero_stage=1)), 2),
    "zero3->0, world 2->4": ("zero3", 2, parity_config(), 4),
    "zero0->3": ("dp2", 2, parity_config(parallel=dict(zero_stage=3)), 2),
    "tp2->1": ("tp2-sp", 2, parity_config(), 2),
    "tp1->2": ("dp2", 2, parity_config(parallel=dict(tp=2, sequence_parallel=True)), 2),
    # The same degrees, but the saved run had no replicated dropout stream to restore.
    "tp2 sequence parallelism off": ("tp2-sp", 2, parity_config(parallel=dict(tp=2)), 2),
    "pp2->tp2": ("pp2-gpipe-2l", 2, parity_config(parallel=dict(tp=2)), 2),
    "host offload->none": ("zero3-host-offload", 2, parity_config(parallel=dict(tp=2)), 2),
    "gpipe->interleaved": ("pp2-gpipe", 2,
                           pipeline_config(schedule="interleaved-1f1b", virtual_stages=2), 2),
}
SAVED_ELSEWHERE = {
    "dp4-zero1": (parity_config(parallel=dict(zero_stage=1)), 4),
    "pp2-gpipe-2l": (pipeline_config(schedule="gpipe", model={"n_layers": 2}), 2),
}


def _three(name: str, cfg, root: Path) -> list[Case]:
    """Interrupted (saves after STOP), uninterrupted, resumed: in this order."""
    folder = str(root / name)
    return [Case(f"{name}-part", cfg, save_to=folder, steps=STOP),
            Case(f"{name}-full", cfg, params=True),
            Case(f"{name}-resumed", cfg, resume_from=folder, params=True)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of this module, in as few spawned worlds as the dependencies allow."""
    root = tmp_path_factory.mktemp("checkpoints")
    out: dict = {}

    def record(cases: list[Case], world: int) -> None:
        for case, ranks in zip(cases, run_layouts(cases, world, STEPS, timeout=600)):
            out[case.id] = ranks

    first = [c for name, cfg in WORLD2.items() for c in _three(name, cfg, root)]
    first.append(Case("pp2-gpipe-2l-part", SAVED_ELSEWHERE["pp2-gpipe-2l"][0],
                      save_to=str(root / "pp2-gpipe-2l"), steps=STOP))
    record(first, 2)
    at4 = [Case("dp4-zero1-part", SAVED_ELSEWHERE["dp4-zero1"][0],
                save_to=str(root / "dp4-zero1"), steps=STOP)]
    loads = {2: [], 4: []}
    for pair, (source, _, cfg, world) in RESHARD.items():
        loads[world].append(Case(pair, cfg, resume_from=str(root / source), params=True))
    record(at4 + loads[4], 4)
    record(loads[2], 2)
    record(_three("3d", THREE_D, root), 8)
    # 8 -> 1: the 3D checkpoint loaded by one process.
    out["3d->1"] = [train_layout(0, 1, single_process(THREE_D), STEPS, params=True,
                                 resume_from=str(root / "3d"))]
    out["root"] = root
    return out


def _bitwise(full: dict, resumed: dict) -> list[str]:
    problems = []
    if resumed["losses"] != full["losses"][STOP:]:
        problems.append(f"losses {resumed['losses']} vs {full['losses'][STOP:]}")
    for name, (_, value) in full["params"].items():
        if not torch.equal(resumed["params"][name][1], value):
            problems.append(f"parameter {name}")
    return problems


@pytest.mark.parametrize("name", [*WORLD2, "3d"])
def test_resume_in_the_same_layout_is_bitwise_exact(runs, name):
    for rank, (full, resumed) in enumerate(zip(runs[f"{name}-full"], runs[f"{name}-resumed"])):
        assert not _bitwise(full, resumed), f"{name} rank {rank}: {_bitwise(full, resumed)}"
        assert len(resumed["losses"]) == STEPS - STOP


@pytest.mark.parametrize("pair", [*RESHARD, "3d->1"])
def test_a_checkpoint_loads_into_another_layout(runs, pair):
    cfg = THREE_D if pair == "3d->1" else RESHARD[pair][2]
    ref = reference(cfg, STEPS, params=True)
    ref = dict(ref, losses=ref["losses"][STOP:], norms=ref["norms"][STOP:])
    for rank, got in enumerate(runs[pair]):
        actual, expected = compare_to_reference(got, ref)
        assert_parity(actual, expected, FLOAT64_TOL, f"{pair} rank {rank}")
    # Each rank read its share of the checkpoint, not all of it (ZeRO-0 ranks, which
    # hold everything, read everything).
    if pair in ("world 4->2 (zero1)", "zero0->3"):
        total = sum(_saved_bytes(runs["root"] / RESHARD[pair][0]).values())
        for rank, got in enumerate(runs[pair]):
            assert 0 < got["bytes_read"] < 0.6 * total, (pair, rank, got["bytes_read"], total)


def _saved_bytes(root: Path) -> dict[str, int]:
    """Bytes of parameter state (not random streams) per rank file of a checkpoint."""
    manifest = read_manifest(resolve(root))
    out = {}
    for f in manifest["files"]:
        out[f["name"]] = sum(t["numel"] * (8 if t["dtype"] == "float64" else 4)
                             for t in f["tensors"] if not t["key"].startswith("rng/"))
    return out


def test_another_optimizers_checkpoint_is_refused(runs, tmp_path):
    import shutil

    copy = tmp_path / "sgd"
    shutil.copytree(resolve(runs["root"] / "zero3"), copy)
    manifest = read_manifest(copy)
    manifest["optimizer"]["name"] = "sgd"
    write_manifest(copy, manifest)
    cfg = parity_config(parallel=dict(zero_stage=3))
    pm = build_parallel_model(cfg, Mesh(dims_from_config(cfg, 1), 0, 1), torch.device("cpu"))
    with pytest.raises(CheckpointMismatch, match="optimizer 'sgd'"):
        load_checkpoint(pm, copy)


def test_loss_scaling_state_carries_only_between_float16_runs(runs, tmp_path):
    """A float16 run's loss scale resumed in float32 would multiply every loss with
    nothing dividing it out (the pipeline and the MoE losses scale by it); a float32
    run's scale of 1 resumed in float16 would start scaling from 1 instead of its
    initial scale."""
    import shutil

    fp16_like = tmp_path / "fp16"
    shutil.copytree(resolve(runs["root"] / "zero3-fp32"), fp16_like)
    manifest = read_manifest(fp16_like)
    manifest["scaler"] = {"scale": 65536.0, "clean_steps": 2, "skips": 0, "enabled": True}
    write_manifest(fp16_like, manifest)

    def loaded_scale(folder: Path, precision: dict) -> float:
        cfg = parity_config(precision=precision, **F32)
        pm = build_parallel_model(cfg, Mesh(dims_from_config(cfg, 1), 0, 1),
                                  torch.device("cpu"))
        load_checkpoint(pm, folder)
        return pm.dp.loss_scale

    assert loaded_scale(fp16_like, {}) == 1.0
    assert loaded_scale(fp16_like, dict(param_dtype="bfloat16")) == 1.0
    assert loaded_scale(fp16_like, dict(param_dtype="float16")) == 65536.0
    fresh = parity_config(precision=dict(param_dtype="float16"), **F32)
    initial = build_parallel_model(fresh, Mesh(dims_from_config(fresh, 1), 0, 1),
                                   torch.device("cpu")).dp.loss_scale
    assert initial > 1.0
    assert loaded_scale(resolve(runs["root"] / "zero3-fp32"),
                        dict(param_dtype="float16")) == initial


def test_precision_changes_on_load(runs):
    """float32 (zero3-fp32) -> bfloat16 parameters with fp32 master weights: the master
    copy is the saved float32 value exactly, the parameters its bf16 rounding; the
    moments come along unchanged."""
    folder = resolve(runs["root"] / "zero3-fp32")
    cfg = parity_config(precision=dict(param_dtype="bfloat16"), **F32)
    pm = build_parallel_model(cfg, Mesh(dims_from_config(cfg, 1), 0, 1), torch.device("cpu"))
    load_checkpoint(pm, folder)
    saved = {state: dict(full_tensors(folder, state)) for state in ("param", "exp_avg")}
    checked = 0
    for sl in pm.dp.owned_slices():
        for pc in sl.pieces:
            name, n = pc.entry.info.name, pc.stop - pc.start
            at = slice(pc.buf_start - sl.lo, pc.buf_start - sl.lo + n)
            want = saved["param"][name].reshape(-1)[pc.start:pc.stop]
            assert torch.equal(sl.master[at], want), name
            assert torch.equal(sl.param[at], want.to(torch.bfloat16)), name
            assert torch.equal(sl.exp_avg[at],
                               saved["exp_avg"][name].reshape(-1)[pc.start:pc.stop]), name
            checked += 1
    assert checked == len(saved["param"])
