"""Launch-time faults end with one message within a bound, never a silent wait."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from partita.testing import free_port


def partita(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "partita.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_a_missing_node_stops_the_job_after_the_rendezvous_timeout(tmp_path):
    start = time.monotonic()
    result = partita("train", "--nproc", "1", "--nnodes", "2", "--rdzv-timeout", "5",
                     f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=alone",
                     "--data.max_bytes=100000", f"--data.cache_dir={tmp_path / 'cache'}",
                     f"--train.out_dir={tmp_path / 'run'}")
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr[-2000:]
    assert "did not all join the rendezvous" in result.stderr
    assert "Traceback" not in result.stderr
    assert elapsed < 90


@pytest.mark.parametrize("setting", [
    "--train.steps=0", "--train.steps=-3", "--train.lr=-0.1", "--train.grad_clip=-1",
    "--train.beta1=1.5", "--train.microbatches=0", "--train.eval_every=0",
    "--train.log_every=0", "--model.dropout=2.0", "--train.threads=-1",
    "--train.collective_timeout_s=0", "--train.device=tpu",
])
def test_nonsense_is_refused_before_launch(setting, tmp_path):
    result = partita("train", setting, f"--train.out_dir={tmp_path / 'run'}", timeout=60)
    assert result.returncode == 2
    assert setting.split("=")[0].lstrip("-") in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags", [["--nproc", "0"], ["--nproc", "-2"], ["--nnodes", "0"],
                                   ["--rdzv-timeout", "0"]])
def test_launcher_counts_out_of_range_are_refused(flags, tmp_path):
    result = partita("train", *flags, f"--train.out_dir={tmp_path / 'run'}", timeout=60)
    assert result.returncode == 2
    assert flags[0] in result.stderr and "Traceback" not in result.stderr
