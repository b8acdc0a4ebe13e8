"""Layouts the planner ranks actually train: one per kind of combination (and every ZeRO
stage at least once) runs 2 steps through the real `partita train`, with the settings
`partita plan` prints, and all give the loss curve of one another (float64)."""

import json
import os
import subprocess
import sys

import pytest

from partita.config import Config, layout_overrides
from partita.layout import Layout
from partita.planner import make_request, search

DEFAULTS = Config()  # the tiny model, seq 128, global batch 16: what the planner planned
SEQ, BATCH = DEFAULTS.data.seq_len, DEFAULTS.train.global_batch
RUN = ["--train.steps=2", "--train.log_every=1", "--train.eval_every=100",
       "--train.eval_batches=1", "--train.threads=1", "--train.dtype=float64",
       "--train.warmup_steps=1", "--data.max_bytes=300000", "--metrics.tensorboard=false"]

# (world, parallel dimensions above 1, ZeRO stage): every ZeRO stage at least once
# (stage 3 cannot go with a pipeline), one 8-rank run. tp alone trains in
# tests/e2e/test_cli.py's loss curves; tp x pp and dp x pp are inside the 8-rank
# dp x tp x pp run.
WANTED = [(2, ("dp",), 1), (2, ("pp",), 0), (4, ("dp", "tp"), 3), (8, ("dp", "tp", "pp"), 2)]


def _pick(world: int, dims: tuple[str, ...], zero: int) -> Layout:
    """The fastest ranked layout of that shape and stage."""
    req = make_request(DEFAULTS.model.name, world, seq_len=SEQ, global_batch=BATCH)
    for ev in search(req).ranked:
        lay = ev.layout
        shape = tuple(d for d in ("dp", "tp", "pp") if getattr(lay, d) > 1)
        if shape == dims and lay.zero_stage == zero:
            return lay
    raise AssertionError(f"the planner ranks no {dims} layout with ZeRO-{zero} on {world}")


def _train(world: int, layout: Layout, out, cache) -> list[float]:
    args = [sys.executable, "-m", "partita.cli", "train", "--nproc", str(world),
            *layout_overrides(layout, BATCH), *RUN, f"--data.cache_dir={cache}",
            f"--train.out_dir={out}"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, f"{layout.describe()}:\n{result.stderr[-3000:]}"
    assert result.stdout.strip().splitlines()[-1].startswith("done: 2 steps"), result.stdout
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_a_sample_of_planned_layouts_trains(tmp_path):
    cache = tmp_path / "cache"
    curves = {}
    for world, dims, zero in WANTED:
        layout = _pick(world, dims, zero)
        curves[layout.describe()] = _train(world, layout, tmp_path / "x".join(dims), cache)
    first = next(iter(curves.values()))
    assert len(first) == 2
    for name, curve in curves.items():
        assert curve == pytest.approx(first, rel=1e-10), name
