"""`partita train` with a disk-offload folder another job's rank holds is refused before
it writes there; a worker restarted by the launcher (--max-restarts) is not.

Both jobs' rank 0 files were named `rank0.*` in the shared folder, so the second job
overwrote the first one's optimizer state without a word.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist.test_offload_dir_lock import _start_holder

pytestmark = pytest.mark.fault_suite("output folder")

DISK = ("--parallel.offload=optimizer+disk", "--parallel.host_memory_budget_gb=0.001")


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.glob("rank0.*.bin"))}


def test_a_second_job_on_a_held_offload_dir_is_refused(tmp_path, run_dir, cli):
    shared = tmp_path / "offload"
    shared.mkdir()
    holder = _start_holder(shared)
    try:
        before = _digests(shared)
        started = time.monotonic()
        result = cli.train(run_dir, "--nproc", "1", *DISK, f"--parallel.offload_dir={shared}",
                           "--train.collective_timeout_s=20", timeout=200)
        assert time.monotonic() - started < 200
        assert result.returncode != 0
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        assert (f"parallel.offload_dir '{shared}' is in use by another partita job "
                f"(pid {holder.pid} on") in result.stderr, result.stderr[-3000:]
        assert "another parallel.offload_dir" in result.stderr
        assert _digests(shared) == before
        assert holder.poll() is None
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_a_restarted_worker_takes_its_offload_files_again(tmp_path, run_dir, cli):
    # The step-2 checkpoint is written before step 3 starts (no background writer), so
    # the restart always resumes from it, however loaded the machine.
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PARTITA_FAULT": "rank=1,step=3,at=optimizer,do=kill"}
    result = subprocess.run(
        [sys.executable, "-m", "partita.cli",
         *cli.train_args(run_dir, "--nproc", "2", "--max-restarts", "1", *DISK,
                         f"--parallel.offload_dir={tmp_path / 'offload'}",
                         "--train.checkpoint_every=2", "--train.async_checkpoint=false",
                         "--train.collective_timeout_s=20")],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restart 1 of 1" in result.stderr and "in use" not in result.stderr
    assert "resumed from" in result.stdout
