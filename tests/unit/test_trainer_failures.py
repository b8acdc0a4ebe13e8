"""What a training process reports for what it caught (`partita.trainer_failures`):
running out of memory is the settings' (said where, with the device's size), a failed
collective names the process to look at, and anything else stays a fault of partita's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.errors import OutOfDeviceMemory, PeerFailure
from partita.trainer_failures import told_failure


class _Progress:  # the two fields and the one method told_failure reads
    step, phase = 7, "forward and backward"

    @staticmethod
    def culprits() -> str:
        return "rank 1 (last seen in step 7)"


PROGRESS = _Progress()


def _told(exc: BaseException, progress=PROGRESS) -> BaseException:
    return told_failure(exc, progress, torch.device("cpu"), None, 30.0)


def test_out_of_device_memory_says_where():
    told = _told(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert isinstance(told, OutOfDeviceMemory) and not told.on_cpu
    assert str(told) == ("process 0 ran out of device memory in forward and backward of "
                         "step 7 (CUDA out of memory. Tried to allocate 2.00 GiB).")
    assert told.device_bytes is None  # a CPU device: no GPU size to give
    before = _told(torch.OutOfMemoryError("CUDA out of memory."), progress=None)
    assert "while it was set up" in str(before)


def test_a_failed_cpu_allocation_is_told_from_the_allocators_words():
    text = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
            "allocate memory: you tried to allocate 400 bytes. Error code 12")
    told = _told(RuntimeError(text))
    assert isinstance(told, OutOfDeviceMemory) and told.on_cpu
    assert "(DefaultCPUAllocator: can't allocate memory: you tried" in str(told)
    assert "alloc_cpu.cpp" not in str(told)


def test_a_failed_collective_names_the_process_to_look_at():
    told = _told(dist.DistError("Connection closed by peer"))
    assert isinstance(told, PeerFailure)
    assert str(told).startswith("a collective in forward and backward of step 7 failed: "
                                "Connection closed by peer.")
    assert "The process to look at: rank 1 (last seen in step 7)" in str(told)
    assert "train.collective_timeout_s=30 s" in str(told)
    transfer = _told(PeerFailure("pipeline rank 0 waited 5 s for RB1.0."))
    assert str(transfer).endswith("The process to look at: rank 1 (last seen in step 7).")


def test_anything_else_is_returned_as_it_is():
    bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert _told(bug) is bug
