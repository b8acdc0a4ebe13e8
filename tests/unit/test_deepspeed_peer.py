"""A lock left by an interrupted extension build is refused with its path: DeepSpeed's
CPU ops would otherwise wait for it forever (`partita.bench.deepspeed_peer`)."""

from __future__ import annotations

import os

import pytest

from partita.bench.deepspeed_peer import STALE_LOCK_S, check_build_locks
from partita.errors import PartitaError


def test_a_stale_build_lock_is_named_and_a_fresh_one_waited_for(tmp_path):
    """`partita bench zero` stopped by a timeout while DeepSpeed built its shared-memory
    op left py311_cpu/deepspeed_shm_comm/lock; the next test run's ranks waited on it
    for good (a hung suite)."""
    check_build_locks(tmp_path)  # no lock: nothing to say
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    now = lock.stat().st_mtime
    check_build_locks(tmp_path, now=now + 30)  # a build in progress
    with pytest.raises(PartitaError, match=f"rm {lock}") as err:
        check_build_locks(tmp_path, now=now + STALE_LOCK_S + 60)
    assert "11 min old" in str(err.value)
    os.remove(lock)
    check_build_locks(tmp_path, now=now + STALE_LOCK_S + 60)
