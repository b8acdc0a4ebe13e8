"""One job per rank's files in a disk-offload folder (`parallel.offload_dir`).

A rank's files are named by its rank alone, so a second job given the same folder
overwrote the first one's optimizer state without a word (the first job's losses then
went wrong by up to 3.5). The second is refused, naming the folder, the holder's pid
and the fix, before it writes anything; the holder's files are untouched. A killed
holder's lock does not block the next run, another rank of the same folder is not
refused, and a model built again in one process takes its own lock over.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from partita.errors import PartitaError
from partita.memory.disk import DiskOptimizer

SIZE = 3 * 4096 + 5
BUDGET = 1 << 20

HOLDER = f"""
import sys, torch
from partita.memory.disk import DiskOptimizer
disk = DiskOptimizer.create([torch.arange({SIZE}, dtype=torch.float64)], [torch.float64],
                            [[]], torch.float64, sys.argv[1], {BUDGET}, sys.argv[2])
print("ready", flush=True)
sys.stdin.read()  # holds the optimizer (and its lock) until the test closes stdin
"""


def _create(directory: Path, tag: str = "rank0", value: float = 7.0) -> DiskOptimizer:
    return DiskOptimizer.create([torch.full((SIZE,), value, dtype=torch.float64)],
                                [torch.float64], [[]], torch.float64, str(directory), BUDGET,
                                tag)


def _start_holder(directory: Path, tag: str = "rank0") -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), tag],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    return holder


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.glob("*.bin"))}


def test_a_second_job_in_the_folder_is_refused_and_the_first_untouched(tmp_path: Path):
    holder = _start_holder(tmp_path)
    try:
        before = _digests(tmp_path)
        assert before  # the holder's two generations
        with pytest.raises(PartitaError) as refused:
            _create(tmp_path)
        message = str(refused.value)
        assert str(tmp_path) in message and f"pid {holder.pid}" in message
        assert "another parallel.offload_dir" in message
        assert _digests(tmp_path) == before
        # Another rank's files in the same folder (ranks of one job share it).
        other = _create(tmp_path, tag="rank1")
        other.close()
        assert holder.poll() is None
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # Ended: its lock is gone with it.
    _create(tmp_path).close()


def test_a_killed_holder_does_not_block_the_next_run(tmp_path: Path):
    holder = _start_holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    holder.stdin.close()
    holder.stdout.close()
    assert (tmp_path / "rank0.lock").exists()  # left behind, but no longer held
    disk = _create(tmp_path)
    assert torch.equal(disk.read_states(0)["master"], torch.full((SIZE,), 7.0,
                                                                 dtype=torch.float64))
    disk.close()


def test_one_process_building_again_shares_its_lock_and_close_lets_go(tmp_path: Path):
    first = _create(tmp_path)
    second = _create(tmp_path, value=3.0)  # a model built again in the same process
    first.close()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "rank0"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    _, err = holder.communicate(timeout=120)
    assert holder.returncode != 0 and "in use by another partita job" in err
    second.close()
    _start_holder(tmp_path).communicate(timeout=60)  # released: another process takes it
