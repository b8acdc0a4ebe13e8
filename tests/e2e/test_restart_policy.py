"""--max-restarts restarts what a restart can mend (a killed worker: test_checkpoint_cli)
and not an error the run reports itself, which would recur."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.fault_suite("checkpoints")


def test_an_error_the_run_reports_itself_is_not_restarted(run_dir, cli):
    """A NaN (here from a learning rate of 1e6) recurs at every restart, which resumes
    from the same checkpoint with the same data: the job ends after the first."""
    result = subprocess.run([sys.executable, "-m", "partita.cli",
                             *cli.train_args(run_dir, "--nproc", "2", "--max-restarts", "2",
                                             "--train.steps=8", "--train.lr=1e6")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("the gradient norm became nan") == 1, result.stderr[-3000:]
    assert "restart 1 of 2" not in result.stderr
    assert ("It was not restarted (--max-restarts): a restart resumes from the same "
            "checkpoint with the same data, so the error would repeat." in result.stderr)
