"""Work that may fail on some processes only (reading a checkpoint) stops the whole job
with one message: the lowest-numbered failing process raises its own error, every
other process a quiet PeerReported, and none waits for a collective to time out."""

from __future__ import annotations

import pytest
import torch

from partita.agreement import stop_together
from partita.errors import PartitaError, PeerReported
from partita.local_world import run_distributed

pytestmark = pytest.mark.fault_suite("checkpoints")


def _outcome(rank: int, world: int, failing: tuple[int, ...]) -> str:
    failure = PartitaError(f"file of rank {rank} is damaged") if rank in failing else None
    try:
        stop_together(failure, torch.device("cpu"), "reading the checkpoint")
    except PeerReported as exc:
        return f"quiet: {exc}"
    except PartitaError as exc:
        return f"own: {exc}"
    return "went on"


@pytest.mark.parametrize("failing", [(), (2,), (1, 2), (0, 1, 2)])
def test_the_first_failing_process_reports_and_the_others_stop_quietly(failing):
    outcomes = run_distributed(_outcome, 3, (failing,), timeout=60)
    if not failing:
        assert outcomes == ["went on"] * 3
        return
    first = min(failing)
    for rank, outcome in enumerate(outcomes):
        if rank == first:
            assert outcome == f"own: file of rank {rank} is damaged"
        else:
            assert outcome == (f"quiet: process {first} failed while reading the "
                               "checkpoint and reports why; this process stopped with it.")


def test_one_process_raises_its_own_error():
    with pytest.raises(PartitaError, match="damaged"):
        stop_together(PartitaError("damaged"), torch.device("cpu"), "reading")
    stop_together(None, torch.device("cpu"), "reading")  # nothing failed: nothing raised


def _refuses(rank: int, world: int) -> None:
    raise PartitaError("heads=4 is not divisible by tp=3; valid tp degrees: [1, 2, 4].")


def test_a_rank_refusing_bad_input_is_one_line_for_the_command_line():
    """Benchmarks run their ranks through run_distributed: a layout a rank refused
    reached the user as two nested tracebacks with exit 1."""
    from partita.local_world import RankRefused

    with pytest.raises(RankRefused) as info:
        run_distributed(_refuses, 2, timeout=60)
    text = str(info.value)
    assert isinstance(info.value, PartitaError) and isinstance(info.value, RuntimeError)
    assert "failed: heads=4 is not divisible by tp=3" in text and "Traceback" not in text


def _one_rank_killed(rank: int, world: int, survivor_waits_in: str) -> None:
    import os
    import signal
    import time

    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does
    if survivor_waits_in == "collective":
        dist.all_reduce(torch.ones(4))  # fails once the peer's connection closes
    time.sleep(60)


@pytest.mark.parametrize("survivor_waits_in", ["collective", "python"])
def test_a_killed_rank_is_named_as_the_cause(survivor_waits_in):
    """A rank the out-of-memory killer ended reached a `partita bench zero` user as
    another rank's 70-line traceback about a connection reset by its peer."""
    from partita.local_world import RankKilled

    with pytest.raises(RankKilled) as info:
        run_distributed(_one_rank_killed, 2, (survivor_waits_in,), timeout=50)
    text = str(info.value)
    assert text.startswith("rank 1 of 2 was killed by SIGKILL, most often the kernel's "
                           "out-of-memory killer"), text
    assert "Traceback" not in text and isinstance(info.value, PartitaError)
    if survivor_waits_in == "collective":
        assert "Rank 0 then failed: " in text
