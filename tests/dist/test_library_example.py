"""docs/library_example.py, the example of docs/library.md, as a user runs it: under
torchrun with 2 processes. Its saved weights must equal one process trained with
torch.optim.AdamW on the whole batch (float64, 1e-10), and the page must show the file
as it is."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from partita.testing import FLOAT64_TOL, assert_parity, free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "library_example.py"
STEPS, MICRO = 6, 2


def _example():
    spec = importlib.util.spec_from_file_location("library_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference() -> dict[str, torch.Tensor]:
    """One process, the whole batch, torch's AdamW with decay on matrices only."""
    ex = _example()
    torch.manual_seed(0)
    model = ex.TinyLM().double()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                             {"params": [p for p in params if p.ndim < 2],
                              "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(STEPS):
        tokens = ex.global_batch(step)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_page_shows_the_example_file() -> None:
    page = (ROOT / "docs" / "library.md").read_text()
    block = page.split("<!-- library_example.py -->\n```python\n", 1)[1].split("```", 1)[0]
    assert block == EXAMPLE.read_text()


@pytest.mark.parametrize("stage", [1, 3])
def test_the_example_trains_as_one_process_under_torchrun(stage: int, tmp_path) -> None:
    out = tmp_path / "weights.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), f"--log-dir={tmp_path / 'torchrun-logs'}", str(EXAMPLE), "--zero-stage", str(stage),
         "--steps", str(STEPS), "--microbatches", str(MICRO), "--dtype", "float64",
         "--out", str(out)],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"step {STEPS - 1}: loss" in run.stdout
    got = torch.load(out)
    assert_parity(got, _reference(), FLOAT64_TOL, f"library example, ZeRO-{stage}")
