"""The parity harness: run a layout and one process through the same build path, compare.

A parallel layout is correct when it trains like one process given the same global
batch and the same initial weights. This module is the one way the tests check that:

    cases = [Case("tp2-sp", parity_config(parallel=dict(tp=2, sequence_parallel=True)))]
    check_layouts(cases, world=2, steps=10)

- `parity_config` builds a `Config` for a tiny float64 model from TOML-style sections.
- `run_layouts` trains each configuration on a spawned local world (gloo, one thread per
  rank) through `parallelize.build_parallel_model` (or `parallelize` of a case's own
  model, such as transformers' Llama); `reference` trains the same configuration at
  world size 1 through the very same call (no layout: tp, pp, dp and ZeRO off, the whole
  batch in one microbatch).
- `token_batch` is the one batch maker: both sides draw step `s` from it.
- `assert_parity(actual, expected, tol, what)` compares two dicts of named quantities
  with one definition of relative error (see `relative_error`).
- `check_layouts` does all of that for a list of cases and also checks that the ranks
  together hold every parameter of the reference.

Tolerances: float64 parity within `FLOAT64_TOL` = 1e-10 relative (a correct layout lands
near 1e-13, reduction order being the only difference); float32 within `FLOAT32_TOL` =
1e-4 (reduction order alone moves a correct data-parallel run's float32 weights by up
to 7e-5 over 10 steps at the default learning rate of 3e-3, and by 1.6e-4 at 1e-2:
measured, so float32 cases train at the default rate). Tests that drive a lower-level API on models outside the catalog (a toy
model under `DataParallel`) use `token_batch` and `assert_parity` directly.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from partita.checkpoint import CheckpointWriter, load_checkpoint, manifest_fields, resolve
from partita.config import Config, ParallelSection, load_config
from partita.local_world import free_port, run_distributed
from partita.mesh import Mesh
from partita.models.plan import ModelPlan
from partita.parallelize import ParallelModel, build_parallel_model, dims_from_config, parallelize
from partita.sharding import ShardInfo, shard_info
from partita.weights import full_state_dict

__all__ = [
    "FLOAT32_TOL", "FLOAT64_TOL", "PARITY_FLOOR", "PARITY_MODEL", "Case", "assert_parity",
    "check_layouts", "compare_to_reference", "free_port", "parity_config", "reference",
    "relative_error", "run_distributed", "run_layouts", "single_process", "token_batch",
    "train_layout",
]

FLOAT64_TOL = 1e-10
FLOAT32_TOL = 1e-4
# Denominator floor of `relative_error`: a quantity that is zero in exact arithmetic
# comes out of float64 as rounding noise on both sides (the key bias gradient: softmax
# ignores a constant added to every score, so it is ~1e-20 here, with unrelated values
# on each side); measured against its own size a correct layout would show an error of
# order 1. Every other quantity these tests compare is far larger (losses ~2-4, norms
# ~1, weights ~0.07 and up; the smallest gradient, the first step's query projection,
# 8.6e-5: measured on the parity model), so the floor never hides a real difference:
# at 1e-10 it lets through at most 1e-16 absolute, float64 rounding of a value of 1.
PARITY_FLOOR = 1e-6

# The tiny model every parity test trains unless it says otherwise (GQA: 4 heads, 2 kv).
PARITY_MODEL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    max_seq_len=16)
# AdamW divides each gradient entry by its running magnitude plus eps, so at eps 1e-8 an
# entry whose gradient is near zero moves by about lr x (its rounding error / eps): the
# key bias, whose gradient is zero in exact arithmetic (softmax ignores a constant added
# to every score), and now and then an entry of another weight then differ between
# layouts by 1e-10 to 1e-9 after a few steps. At 1e-4 such updates stay proportional to
# the gradient, so every parameter of every layout is compared at 1e-10.
PARITY_ADAM_EPS = 1e-4
_PARITY_DEFAULTS = {
    "model": PARITY_MODEL,
    "data": dict(seq_len=16),
    "train": dict(global_batch=8, microbatches=1, dtype="float64", eps=PARITY_ADAM_EPS),
}


# Comparing ---------------------------------------------------------------------------

def relative_error(actual: Any, expected: Any, floor: float = PARITY_FLOOR) -> float:
    """How far `actual` is from `expected`, relative to `expected`'s size.

    A tensor (or array) is one quantity whose entries share a scale:
        max|a - b| / max(max|b|, floor).
    A number is the one-entry case. A list or tuple of numbers is a series of separate
    quantities (a loss per step) and each is measured on its own scale: the result is
    the largest of the per-entry errors. Shapes must match; NaN anywhere gives NaN.
    """
    if isinstance(expected, list | tuple):
        if not isinstance(actual, list | tuple) or len(actual) != len(expected):
            raise AssertionError(f"series lengths differ: {_size(actual)} vs {len(expected)}")
        return max((relative_error(a, b, floor) for a, b in zip(actual, expected)),
                   default=0.0)
    a, b = _float64(actual), _float64(expected)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    if torch.isnan(a).any() or torch.isnan(b).any():
        return math.nan
    return float((a - b).abs().max() / max(float(b.abs().max()), floor))


def _float64(x: Any) -> torch.Tensor:
    # Python floats straight to float64: torch.as_tensor would make them float32.
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    return torch.as_tensor(x, dtype=torch.float64)


def _size(x: Any) -> str:
    return str(len(x)) if isinstance(x, list | tuple) else type(x).__name__


def assert_parity(actual: Mapping[str, Any], expected: Mapping[str, Any], tol: float,
                  what: str) -> None:
    """Every quantity of `expected` is in `actual` within `tol` (`relative_error`).

    Both are dicts name -> tensor, array, float or list of floats, with the same names.
    The message names `what` and each quantity that differs, worst first.
    """
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing or extra:
        raise AssertionError(f"{what}: quantities differ: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
    bad = []
    for name in expected:
        try:
            err = relative_error(actual[name], expected[name])
        except AssertionError as exc:
            bad.append((math.inf, f"{name}: {exc}"))
            continue
        if not err <= tol:  # NaN fails too
            bad.append((err if err == err else math.inf, f"{name}: {err:.2e}"))
    if bad:
        bad.sort(key=lambda item: -item[0])
        lines = "\n  ".join(text for _, text in bad[:10])
        more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise AssertionError(f"{what}: {len(bad)} of {len(expected)} quantities differ by "
                             f"more than {tol:.0e} relative:\n  {lines}{more}")


# Configurations and data -------------------------------------------------------------

def parity_config(**sections: Mapping[str, Any]) -> Config:
    """A `Config` for the parity model, each keyword a config section's settings:

        parity_config(parallel=dict(tp=2, sequence_parallel=True), train=dict(lr=1e-2))

    Settings go through the same override path as `--section.key=value` on the command
    line; a section given here updates the harness defaults (float64, the 64-token,
    2-layer `PARITY_MODEL`, sequences of 16 tokens, 8 per step, one microbatch).
    """
    merged: dict[str, dict[str, Any]] = {k: dict(v) for k, v in _PARITY_DEFAULTS.items()}
    for section, values in sections.items():
        merged.setdefault(section, {}).update(values)
    overrides = [f"--{section}.{key}={_override_value(value)}"
                 for section, values in merged.items() for key, value in values.items()]
    return load_config(None, overrides)


def _override_value(value: Any) -> str:
    return "none" if value is None else str(value)


def single_process(cfg: Config) -> Config:
    """`cfg` without a layout: every parallel setting at its default (one process, no
    ZeRO, no pipeline), the whole batch in one microbatch."""
    return dataclasses.replace(copy.deepcopy(cfg), parallel=ParallelSection(),
                               train=dataclasses.replace(cfg.train, microbatches=1))


def token_batch(step: int, size: int, seq_len: int, vocab: int) -> torch.Tensor:
    """The global batch of step `step`: `size` rows of `seq_len + 1` tokens (inputs are
    row[:-1], targets row[1:]).

    Learnable sequences (next = 5 * token + 3 mod vocab, random starts seeded by the
    step), so the loss falls steadily and every step's gradient carries signal; uniform
    random tokens leave only noise, which AdamW amplifies into large relative swings.
    """
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.empty(size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (size,), generator=gen)
    for t in range(seq_len):
        tokens[:, t + 1] = (5 * tokens[:, t] + 3) % vocab
    return tokens


def _step_batch(cfg: Config, step: int) -> torch.Tensor:
    return token_batch(step, cfg.train.global_batch, cfg.data.seq_len,
                       cfg.model_config().vocab_size)


# Training ----------------------------------------------------------------------------

Probe = Callable[[ParallelModel, Config], Any]
# Builds a model partita did not write, on the meta device, with its plan; a module-level
# function, so that it reaches the spawned ranks. None: partita's Transformer from cfg.
ModelFn = Callable[[], tuple[nn.Module, ModelPlan]]


def train_layout(rank: int, world: int, cfg: Config, steps: int,
                 grads_at: Iterable[int] = (), params: bool = False,
                 probe: Probe | None = None, model: ModelFn | None = None,
                 save_to: str = "", resume_from: str = "",
                 weights: bool = False) -> dict[str, Any]:
    """Train `cfg` for `steps` AdamW steps on this rank of a `world`-rank world.

    With `resume_from` (a checkpoint, or a folder of them: its newest), the run loads it
    first and trains only the steps after the checkpoint's (losses and norms then start
    there); with `save_to` it writes a checkpoint of the final state into that folder.

    Each step: this replica's share of `token_batch`, the runner's forward and backward
    over `train.microbatches`, gradient sync, the global gradient norm (clipped at
    `train.grad_clip`, 0 = none), a step at the constant rate `train.lr`. Returns the
    mean loss and gradient norm per step, the validation loss of one more batch, the
    engine's memory ledger, this rank's gradients at the steps in `grads_at` (before
    clipping; without ZeRO only, since ZeRO reduces each rank's own slice alone) and, with `params`, its final parameters, each as (ShardInfo,
    tensor) under its global name; `probe(pm, cfg)`'s result when given; with
    `weights`, the full weights a run writes at its end (`weights.full_state_dict`, on
    rank 0; None elsewhere).
    """
    mesh = Mesh(dims_from_config(cfg, world), rank, world)
    device = torch.device("cpu")
    pm = (build_parallel_model(cfg, mesh, device) if model is None
          else parallelize(*model(), cfg, mesh, device))
    dp, loss_comm, pipe = pm.dp, mesh.comm("loss_average"), mesh.comm("pipeline")
    out: dict[str, Any] = {"losses": [], "norms": [], "grads": {}}
    if probe is not None:
        out["probe"] = probe(pm, cfg)

    def mean(local: float) -> float:
        # Only the last pipeline stage has a loss; each replica has its own.
        (total,) = pipe.all_reduce_scalars(loss_comm.all_reduce_scalars([local]))
        return total / loss_comm.size

    def mine(tokens: torch.Tensor) -> torch.Tensor:
        # Rows by replica; context-parallel ranks of a replica split the sequence (the
        # runner keeps their chunks).
        data = mesh.comm("data")
        return tokens.chunk(data.size)[data.index]

    grads_at, clip = set(grads_at), cfg.train.grad_clip or None
    first = 0
    if resume_from:
        loaded = load_checkpoint(pm, resolve(Path(resume_from)), cfg.data.seed)
        first, out["bytes_read"] = loaded.step, loaded.bytes_read
    for step in range(first, steps):
        tokens = mine(_step_batch(cfg, step))
        local = pm.runner.train(tokens[:, :-1], tokens[:, 1:], cfg.train.microbatches)
        dp.finish_grad_sync()
        if step in grads_at:
            for name, (info, grad) in _named(pm, lambda p: p.grad).items():
                out["grads"][step, name] = (info, grad)
        out["norms"].append(dp.clip_grad_norm_(clip))
        out["losses"].append(mean(local))
        dp.step(cfg.train.lr)
        dp.zero_grad()
    tokens = mine(_step_batch(cfg, steps))
    out["val"] = mean(pm.runner.evaluate(tokens[:, :-1], tokens[:, 1:]))
    out["ledger"] = dp.memory_ledger()
    if save_to:
        writer = CheckpointWriter(Path(save_to), rank, world, async_save=False)
        writer.save(steps, pm, manifest_fields(pm, {}, cfg.to_toml(), cfg.layout(world)))
        if writer.failure:
            raise RuntimeError(writer.failure)
    if params:
        with dp.gathered_parameters():
            out["params"] = _named(pm, lambda p: p)
    if weights:
        out["weights"] = full_state_dict(pm)
    return out


def _named(pm: ParallelModel, what: Callable) -> dict[str, tuple[ShardInfo, torch.Tensor]]:
    out = {}
    for name, p in pm.module.named_parameters():
        value = what(p)
        if value is None:
            raise ValueError(f"{name} has no gradient to record (record gradients "
                             "without ZeRO only, where each rank holds them whole)")
        info = shard_info(p, name)
        # A copy: the engine reuses its buffers, and a view would pickle all of them.
        out[info.name] = (info, value.detach().clone())
    return out


@dataclass(frozen=True)
class Case:
    """One layout to check against one process: a name, its config, its tolerance, and
    what to record beyond losses and norms (gradients at some steps, final parameters)."""

    id: str
    cfg: Config
    tol: float = FLOAT64_TOL
    grads_at: tuple[int, ...] = ()
    params: bool = False
    model: ModelFn | None = None  # None: partita's own Transformer
    save_to: str = ""  # write a checkpoint of the final state into this folder
    resume_from: str = ""  # start from this checkpoint (train_layout)
    steps: int = 0  # train this many steps instead of the run's (0: the run's)
    weights: bool = False  # record the full weights a run writes at its end


def _train_cases(rank: int, world: int, cases: list[Case], steps: int,
                 probe: Probe | None) -> list[dict]:
    return [train_layout(rank, world, c.cfg, c.steps or steps, c.grads_at, c.params, probe,
                         c.model, c.save_to, c.resume_from, c.weights)
            for c in cases]


def run_layouts(cases: list[Case], world: int, steps: int, probe: Probe | None = None,
                timeout: float = 240.0) -> list[list[dict]]:
    """`train_layout` for each case, all on one spawned world of `world` ranks;
    result[i][rank] is case i's record on that rank."""
    per_rank = run_distributed(_train_cases, world, args=(cases, steps, probe),
                               timeout=timeout)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]


_REFERENCES: dict[tuple, dict] = {}


def reference(cfg: Config, steps: int, grads_at: Iterable[int] = (),
              params: bool = False, model: ModelFn | None = None,
              probe: Probe | None = None) -> dict[str, Any]:
    """`train_layout` of `single_process(cfg)` in this process at world size 1 (cached)."""
    ref_cfg = single_process(cfg)
    key = (ref_cfg.to_toml(), steps, tuple(sorted(grads_at)), params,
           None if model is None else f"{model.__module__}.{model.__qualname__}", probe)
    if key not in _REFERENCES:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as every rank runs; a tiny model gains nothing more
        try:
            _REFERENCES[key] = train_layout(0, 1, ref_cfg, steps, grads_at, params, probe,
                                            model)
        finally:
            torch.set_num_threads(threads)
    return _REFERENCES[key]


def compare_to_reference(got: dict, ref: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """(actual, expected) for `assert_parity` from one rank's record and the reference:
    losses, gradient norms, validation loss (those the record has), and every gradient
    and parameter this rank recorded against the same slice of the reference's."""
    labels = {"losses": "loss", "norms": "grad norm", "val": "validation loss"}
    actual = {label: got[key] for key, label in labels.items() if key in got}
    expected = {label: ref[key] for key, label in labels.items() if key in got}
    recorded = [(f"grad {name} step {step}", (step, name), info, grad, ref["grads"])
                for (step, name), (info, grad) in got.get("grads", {}).items()]
    recorded += [(f"param {name}", name, info, value, ref.get("params", {}))
                 for name, (info, value) in got.get("params", {}).items()]
    for label, key, info, value, table in recorded:
        actual[label] = value
        if key in table:  # else assert_parity reports a quantity the reference lacks
            full = table[key][1]
            for dim, start, stop in info.cuts:
                full = full.narrow(dim, start, stop - start)
            expected[label] = full
    return actual, expected


def check_layouts(cases: list[Case], world: int, steps: int, probe: Probe | None = None,
                  timeout: float = 240.0
                  ) -> list[tuple[list[dict], dict]]:
    """Run every case on one world of `world` ranks and assert parity with its reference
    on every rank; the ranks together must hold every recorded gradient and parameter
    of the reference. All failures are reported at once. Returns (ranks' records,
    reference) per case for further checks."""
    runs = run_layouts(cases, world, steps, probe, timeout)
    failures, out = [], []
    for case, ranks in zip(cases, runs):
        ref = reference(case.cfg, steps, case.grads_at, case.params, case.model)
        out.append((ranks, ref))
        if steps > 1 and not ref["losses"][-1] < ref["losses"][0]:
            failures.append(f"{case.id}: the reference did not train: {ref['losses']}")
        for rank, got in enumerate(ranks):
            try:
                assert_parity(*compare_to_reference(got, ref), case.tol,
                              f"{case.id} rank {rank}")
            except AssertionError as exc:
                failures.append(str(exc))
        for field in ("grads", "params"):
            held = {key for got in ranks for key in got.get(field, {})}
            lost = sorted(set(ref.get(field, {})) - held, key=str)
            if lost:
                failures.append(f"{case.id}: no rank holds {field} {lost[:5]}")
    assert not failures, "\n".join(failures)
    return out
