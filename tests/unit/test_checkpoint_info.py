"""`partita checkpoint info`: a pipeline's schedule is shown only where there is a
pipeline, the model's max_seq_len is shown, and the `latest` pointer file of a folder
of checkpoints leads to the checkpoint it names (partita.commands.checkpoint)."""

import argparse

import pytest

from partita.checkpoint.manifest import (
    FORMAT,
    VERSION,
    CheckpointFileError,
    write_latest,
    write_manifest,
)
from partita.commands.checkpoint import run_info
from partita.config import load_config

MODEL = {"vocab_size": 64, "dim": 16, "n_layers": 1, "n_heads": 2}


def checkpoint(root, step, pp=1):
    config = load_config(None, ["--model.dim=16", "--model.n_layers=1", "--model.n_heads=2",
                                "--data.seq_len=64", "--model.max_seq_len=96"])
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True)
    write_manifest(folder, {
        "format": FORMAT, "version": VERSION, "step": step, "world_size": pp,
        "partita_version": "0", "torch_version": "0", "created": "then",
        "layout": {"dp": 1, "tp": 1, "pp": pp, "cp": 1, "ep": 1, "zero_stage": 1,
                   "schedule": "1f1b", "virtual_stages": 1, "sequence_parallel": False},
        "model": MODEL, "optimizer": {"steps": step},
        "precision": {"param_dtype": "torch.float32", "master_dtype": "torch.float32"},
        "files": [], "pieces": [], "tensors": {}, "config": config.to_toml()})
    return folder


def info(capsys, path, err: str = "") -> list[str]:
    assert run_info(argparse.Namespace(dir=str(path), tensors=False)) == 0
    out = capsys.readouterr()
    assert out.err == err
    return out.out.splitlines()


def test_one_stage_shows_no_schedule_and_the_max_seq_len(tmp_path, capsys):
    lines = info(capsys, checkpoint(tmp_path, 2))
    assert lines[2] == "  layout: 1 process(es), dp=1 tp=1 pp=1 cp=1 ep=1; zero_stage=1, " \
                       "sequence_parallel=False"
    assert lines[3] == "  model: vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=96"


def test_a_pipeline_shows_its_schedule(tmp_path, capsys):
    lines = info(capsys, checkpoint(tmp_path, 2, pp=2))
    assert lines[2] == "  layout: 2 process(es), dp=1 tp=1 pp=2 cp=1 ep=1; zero_stage=1, " \
                       "schedule=1f1b, virtual_stages=1, sequence_parallel=False"


def test_the_latest_pointer_leads_to_its_checkpoint(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    checkpoint(root, 2)
    newest = checkpoint(root, 4)
    write_latest(root, newest.name)
    lines = info(capsys, root / "latest")
    assert lines[0] == f"checkpoint {newest}"
    assert lines[1].startswith("  step 4 ")


def test_a_stale_pointer_says_which_checkpoint_is_shown(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    older = checkpoint(root, 2)
    newest = checkpoint(root, 4)
    write_latest(root, older.name)
    note = (f"partita: note: {root / 'latest'} names step-00000002, which is not the newest "
            "sound checkpoint beside it; showing step-00000004, the one a resume takes.\n")
    assert info(capsys, root / "latest", err=note)[0] == f"checkpoint {newest}"


def test_another_file_is_named_a_file(tmp_path):
    folder = checkpoint(tmp_path, 2)
    with pytest.raises(CheckpointFileError, match=r"manifest.json' is a file; give a "
                                                  r"checkpoint folder"):
        run_info(argparse.Namespace(dir=str(folder / "manifest.json"), tensors=False))
