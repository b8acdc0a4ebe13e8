"""A Hugging Face Llama folder imported with `model.init_from` at dp, ZeRO-2, ZeRO-3,
tp=2, pp=2 and cp=2 gives transformers' logits and loss (float64, 1e-10), every rank
having read only its own slices; exported back, transformers reproduces partita's
logits; a run that imports, trains 5 steps at tp=2 and exports continues in
transformers with the same loss; and `partita export` of checkpoints written at tp=2
and at pp=2 writes the same folder as an export of the gathered weights.

transformers runs with `tests.hf_models.transformers_in_float64` (its norm and rotary
embedding otherwise compute in float32: a floor of ~2e-7 under the comparison).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from partita.checkpoint import CheckpointWriter, manifest_fields
from partita.comm import gather_along
from partita.config import load_config
from partita.export import export_hf, export_run
from partita.mesh import Mesh
from partita.parallelize import build_parallel_model, dims_from_config
from partita.testing import FLOAT64_TOL, assert_parity, run_distributed, token_batch
from partita.weights import full_state_dict

hf_models = pytest.importorskip("tests.hf_models")

VOCAB, SEQ, BATCH = 64, 16, 4
LAYOUTS = {
    "dp2": dict(dp=2),
    "dp2-zero2": dict(dp=2, zero_stage=2, bucket_mb=0.001),
    "dp2-zero3": dict(dp=2, zero_stage=3, bucket_mb=0.001),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
}


def import_config(folder, **parallel):
    overrides = [f"--model.init_from={folder}", "--train.dtype=float64",
                 f"--data.seq_len={SEQ}", f"--train.global_batch={BATCH}", "--train.lr=3e-3",
                 *[f"--parallel.{k}={v}" for k, v in parallel.items()]]
    return load_config(None, overrides)


def _logits(pm, x: torch.Tensor) -> torch.Tensor | None:
    """Full logits on every rank of a layout without a pipeline or context parallelism
    (None with one: its loss is compared)."""
    if pm.mesh.dims.pp > 1 or pm.mesh.dims.cp > 1:
        return None
    with pm.dp.gathered_parameters():
        logits = pm.module(x)
    return gather_along(logits, pm.mesh.comm("tensor"), -1)[..., :VOCAB]


def _mean_loss(pm, tokens: torch.Tensor, train_steps: int = 0, lr: float = 0.0) -> float:
    """The global batch's mean loss (each replica evaluates its share), after
    `train_steps` AdamW steps on token_batch(0..train_steps-1)."""
    comm, pipe = pm.mesh.comm("loss_average"), pm.mesh.comm("pipeline")
    rows = pm.mesh.comm("data")  # context-parallel peers share rows (the runner splits them)

    def mine(t):
        return t.chunk(rows.size)[rows.index]

    for step in range(train_steps):
        batch = mine(token_batch(step, BATCH, SEQ, VOCAB))
        pm.runner.train(batch[:, :-1], batch[:, 1:], 1)
        pm.dp.finish_grad_sync()
        pm.dp.step(lr)
        pm.dp.zero_grad()
    t = mine(tokens)
    local = pm.runner.evaluate(t[:, :-1], t[:, 1:])
    (total,) = pipe.all_reduce_scalars(comm.all_reduce_scalars([local]))
    return total / comm.size


def _save_checkpoint(pm, cfg, folder: str, rank: int, world: int, step: int) -> None:
    writer = CheckpointWriter(Path(folder), rank, world, async_save=False)
    writer.save(step, pm, manifest_fields(pm, {}, cfg.to_toml(), cfg.layout(world)))
    assert not writer.failure, writer.failure


def _import_each_layout(rank: int, world: int, folders: list[str],
                        tokens: torch.Tensor, checkpoint: str) -> list[dict]:
    out = []
    for i, folder in enumerate(folders):
        out.append({})
        for name, parallel in LAYOUTS.items():
            cfg = import_config(folder, **parallel)
            pm = build_parallel_model(cfg, Mesh(dims_from_config(cfg, world), rank, world),
                                      torch.device("cpu"))
            out[-1][name] = {"logits": _logits(pm, tokens[:, :-1]),
                             "loss": _mean_loss(pm, tokens), "state": full_state_dict(pm)}
            if name == "pp2" and i == 0:
                _save_checkpoint(pm, cfg, checkpoint, rank, world, 0)
    return out


def _hf_loss(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                             tokens[:, 1:].reshape(-1)).item()


def test_imported_llama_matches_transformers_at_every_layout(tmp_path):
    """Untied and tied embeddings, each at every layout, on one world."""
    folders = [hf_models.save_random_llama(tmp_path / f"llama-{tied}", tied=tied)
               for tied in (False, True)]
    tokens = token_batch(99, BATCH, SEQ, VOCAB)
    checkpoint = tmp_path / "pp2-checkpoints"
    runs = run_distributed(_import_each_layout, 2,
                           args=([str(f) for f in folders], tokens, str(checkpoint)),
                           timeout=240)
    for i, folder in enumerate(folders):
        want_logits = hf_models.hf_logits(folder, tokens[:, :-1])
        want_loss = _hf_loss(want_logits, tokens)
        ranks = [run[i] for run in runs]
        for name in LAYOUTS:
            for rank, got in enumerate(ranks):
                actual, expected = {"loss": got[name]["loss"]}, {"loss": want_loss}
                if got[name]["logits"] is not None:
                    actual["logits"], expected["logits"] = got[name]["logits"], want_logits
                assert_parity(actual, expected, FLOAT64_TOL, f"{folder.name} {name} rank {rank}")
        # Exported back from the pipeline's load (gathered from both stages),
        # transformers gives the same logits.
        state = ranks[0]["pp2"]["state"]
        cfg = import_config(folder).model_config()
        out = export_hf(state, cfg, tmp_path / f"exported-{i}")
        again = hf_models.hf_logits(out, tokens[:, :-1])
        assert_parity({"logits": again}, {"logits": want_logits}, FLOAT64_TOL, "exported")
        # Every layout gathered identical full weights.
        for name in LAYOUTS:
            for key, value in state.items():
                assert torch.equal(ranks[0][name]["state"][key], value), (name, key)
    # `partita export` of the pipeline's checkpoint: the same folder.
    _same_folder(export_run(checkpoint, tmp_path / "from-checkpoint"), tmp_path / "exported-0")


def _same_folder(got: Path, want: Path) -> None:
    """The same files, config and tensors (a checkpoint lists tensors in its own order,
    so the index's key order may differ)."""
    from safetensors.torch import load_file

    # `partita export` of an imported run also carries the source's generation defaults.
    extra = {"generation_config.json"}
    assert sorted(p.name for p in got.iterdir() if p.name not in extra) == \
        sorted(p.name for p in want.iterdir())
    assert (got / "config.json").read_text() == (want / "config.json").read_text()
    index = [json.loads((f / "model.safetensors.index.json").read_text()) for f in (got, want)]
    assert index[0] == index[1]
    for path in want.glob("*.safetensors"):
        a, b = load_file(got / path.name), load_file(path)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), path.name


def _train_and_export(rank: int, world: int, folder: str, out: str,
                      tokens: torch.Tensor, checkpoint: str) -> float:
    cfg = import_config(folder, tp=2)
    pm = build_parallel_model(cfg, Mesh(dims_from_config(cfg, world), rank, world),
                              torch.device("cpu"))
    loss = _mean_loss(pm, tokens, train_steps=5, lr=3e-3)
    _save_checkpoint(pm, cfg, checkpoint, rank, world, 5)
    state = full_state_dict(pm)
    if rank == 0:
        export_hf(state, cfg.model_config(), out)
    return loss


def test_import_train_at_tp2_export_continues_in_transformers(tmp_path):
    folder = hf_models.save_random_llama(tmp_path / "llama")
    tokens = token_batch(5, BATCH, SEQ, VOCAB)  # the batch of the 6th step
    before = _hf_loss(hf_models.hf_logits(folder, tokens[:, :-1]), tokens)
    losses = run_distributed(_train_and_export, 2,
                             args=(str(folder), str(tmp_path / "out"), tokens,
                                   str(tmp_path / "checkpoints")), timeout=240)
    after = _hf_loss(hf_models.hf_logits(tmp_path / "out", tokens[:, :-1]), tokens)
    assert_parity({"loss": after}, {"loss": losses[0]}, FLOAT64_TOL, "continued")
    assert after < before - 1e-3, "five steps of training did not change the loss"
    # `partita export` of the tp=2 checkpoint of the same state: the same folder.
    _same_folder(export_run(tmp_path / "checkpoints", tmp_path / "from-checkpoint"),
                 tmp_path / "out")
