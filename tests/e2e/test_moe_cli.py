"""Mixture of experts from the real command line: `tiny-moe` with expert parallelism
(ep=2 on 4 processes) trains on the built-in data with the loss curve of one process
(float64) and logs the auxiliary losses and the load imbalance; an MoE layout on a
dense model is refused before launch (the other bad settings: tests/unit/test_moe.py)."""

from __future__ import annotations

import json

import pytest

from partita.testing import relative_error
from partita.weights import load_weights

MOE = ["--model.name=tiny-moe", "--train.dtype=float64", "--train.steps=3",
       "--train.eval_every=3"]


def test_tiny_moe_ep2_gives_the_single_process_loss_curve(tmp_path, cli):
    runs = {}
    for name, extra in {"single": ["--nproc", "1"],
                        "ep2": ["--nproc", "4", "--parallel.ep=2"]}.items():
        out = tmp_path / name
        result = cli.train(out, *MOE, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "aux " in result.stdout and "imb " in result.stdout, result.stdout[-2000:]
        runs[name] = cli.losses(out)
        record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        assert len(record["tokens_per_expert"]) == 8 and record["imbalance"] >= 1.0
    assert runs["ep2"] == pytest.approx(runs["single"], rel=1e-10)
    # The weights file holds every expert, whole, as one process trained them.
    single, ep2 = (load_weights(tmp_path / n / "model.safetensors") for n in ("single", "ep2"))
    assert single.keys() == ep2.keys()
    assert single["blocks.1.mlp.experts.w_up"].shape[0] == 8
    for name, value in single.items():
        assert relative_error(ep2[name], value) < 1e-10, name


def test_ep_on_a_dense_model_is_refused_before_launch(run_dir, cli):
    result = cli.train(run_dir, "--nproc", "4", "--parallel.ep=2")
    assert result.returncode != 0
    assert "has no MoE blocks" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
