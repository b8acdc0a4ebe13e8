"""Mixture of experts from the real command line: `tiny-moe` with expert parallelism
(ep=2 on 4 processes) trains on the built-in data, logs the auxiliary losses and the
load imbalance and writes whole experts, the same as with the experts split over
tp x ep or their widths over tp; an MoE layout on a
dense model is refused before launch (the other bad settings: tests/unit/test_moe.py)."""

from __future__ import annotations

import json
import math

from partita.weights import load_weights

MOE = ["--model.name=tiny-moe", "--train.dtype=float64", "--train.steps=3",
       "--train.eval_every=3"]


def test_tiny_moe_ep2_trains_and_writes_every_expert_whole(tmp_path, cli):
    # Parity of this layout with one process (losses, auxiliary losses, every parameter,
    # 10 steps, 1e-10) is in dist/test_expert_parallel.py; here: the command line.
    out = tmp_path / "ep2"
    result = cli.train(out, *MOE, "--nproc", "4", "--parallel.ep=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "aux " in result.stdout and "imb " in result.stdout, result.stdout[-2000:]
    losses = cli.losses(out)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(record["tokens_per_expert"]) == 8 and record["imbalance"] >= 1.0
    # The weights file holds every expert, whole: 8 of them in each MoE block.
    weights = load_weights(out / "model.safetensors")
    assert weights["blocks.1.mlp.experts.w_up"].shape[0] == 8
    assert "blocks.0.mlp.experts.w_up" not in weights  # every second block is MoE
    # The experts split over tp x ep (2 of 8 per rank), or over ep with their widths over
    # tp, shared widths halved, are written whole too, and equal the first run's: the
    # same training, other layouts.
    for mode in ("experts", "hidden"):
        split = tmp_path / f"tp2-{mode}"
        result = cli.train(split, *MOE, "--nproc", "4", "--parallel.tp=2", "--parallel.ep=2",
                           f"--parallel.moe_tp={mode}", "--parallel.sequence_parallel=true")
        assert result.returncode == 0, result.stderr[-3000:]
        other = load_weights(split / "model.safetensors")
        assert other.keys() == weights.keys()
        for name, tensor in weights.items():
            assert other[name].shape == tensor.shape, (mode, name)
            assert (other[name] - tensor).abs().max() <= 1e-10 * tensor.abs().max(), (mode, name)


def test_ep_on_a_dense_model_is_refused_before_launch(run_dir, cli):
    result = cli.train(run_dir, "--nproc", "4", "--parallel.ep=2")
    assert result.returncode != 0
    assert "has no MoE blocks" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_moe_checkpoint_shows_and_checks_its_experts_and_does_not_export_to_hf(run_dir, cli):
    steps = ["--train.steps=2", "--train.checkpoint_every=2", "--train.eval_every=100"]
    # train.export=hf on a model with experts: refused before anything trains.
    refused = cli.train(run_dir, *MOE, *steps, "--train.export=hf")
    assert refused.returncode == 2 and "mixture-of-experts" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not run_dir.exists()
    result = cli.train(run_dir, *MOE, *steps)
    assert result.returncode == 0, result.stderr[-3000:]
    info = cli("checkpoint", "info", str(run_dir))
    assert info.returncode == 0, info.stderr
    assert "n_experts=8" in info.stdout and "moe_every=2" in info.stdout, info.stdout
    # The run's weights have no Hugging Face Llama form: `partita export` says so.
    export = cli("export", str(run_dir), "--out", str(run_dir / "hf"))
    assert export.returncode == 2 and "mixture-of-experts" in export.stderr, export.stderr
    assert "do not match" not in export.stderr and not (run_dir / "hf").exists()
    # Resumed as a dense model: refused before launch, naming the setting.
    dense = cli.train(run_dir, *MOE, *steps, "--model.name=tiny", "--train.resume=auto")
    assert dense.returncode == 2, dense.stderr[-2000:]
    assert "n_experts: checkpoint 8, this run 0" in dense.stderr, dense.stderr[-2000:]
    assert "Traceback" not in dense.stderr
    # Another top_k trains on, and the note before launch says what changed.
    top1 = cli.train(run_dir, *MOE, "--train.steps=3", "--train.eval_every=100",
                     "--model.top_k=1", "--train.resume=auto")
    assert top1.returncode == 0, top1.stderr[-3000:]
    assert "top_k: 2 -> 1" in top1.stderr, top1.stderr[-2000:]
