"""How a training process's failure is told: in the words of the user's run.

`told_failure` turns what `partita.trainer.train` caught into the error its process
reports: a failed collective or pipeline transfer names the process to look at (a
victim's message, `PeerFailure`); running out of device or host memory says where
(`OutOfDeviceMemory`, to which `partita train` adds the planner's advice). Anything
else is returned as it is: a fault of partita's, reported with its traceback.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.errors import OutOfDeviceMemory, PeerFailure
from partita.faults import HOST_ALLOCATION_FAILED
from partita.launch import LauncherGone, process_gone
from partita.process_setup import is_peer_failure
from partita.watchdog import Progress


def told_failure(exc: BaseException, progress: Progress | None, device: torch.device | None,
                 launcher: int | None, collective_timeout_s: float) -> BaseException:
    """The error to report for `exc`; `progress` (the trainer's) and `device` are None
    when the trainer was not built yet."""
    if isinstance(exc, PeerFailure):  # a pipeline transfer that timed out
        return PeerFailure(f"{exc} {_culprit_sentence(progress, launcher)}.")
    if isinstance(exc, torch.OutOfMemoryError) or HOST_ALLOCATION_FAILED in str(exc):
        return _out_of_memory(progress, device, exc)  # the settings', not partita's
    if not is_peer_failure(exc):
        return exc
    step, phase = (progress.step, progress.phase) if progress is not None else (0, "setup")
    who = _culprit_sentence(progress, launcher)
    if launcher is None or who != LauncherGone.sentence(launcher):
        who += f"; collectives wait at most train.collective_timeout_s={collective_timeout_s:g} s"
    return PeerFailure(f"a collective in {phase} of step {step} failed: "
                       f"{_first_words(str(exc), 160)}. {who}.")


def _out_of_memory(progress: Progress | None, device: torch.device | None, exc: BaseException
                   ) -> OutOfDeviceMemory:
    """Where this process ran out of device (or, on a CPU, host) memory."""
    where = (f"in {progress.phase} of step {progress.step}" if progress is not None
             else "while it was set up")
    rank = dist.get_rank() if dist.is_initialized() else 0
    text = str(exc)
    if HOST_ALLOCATION_FAILED in text:  # from the allocator's words, not its source line
        return OutOfDeviceMemory(
            f"process {rank} ran out of memory {where} "
            f"({_first_words(text[text.index(HOST_ALLOCATION_FAILED):], 160)}).", None,
            on_cpu=True)
    device_bytes = None
    if torch.cuda.is_available():
        device = device if device is not None else torch.device("cuda")
        if device.type == "cuda":
            device_bytes = float(torch.cuda.get_device_properties(device).total_memory)
    return OutOfDeviceMemory(f"process {rank} ran out of device memory {where} "
                             f"({_first_words(text, 160)}).", device_bytes)


def _first_words(text: str, limit: int) -> str:
    """The first line of `text`, cut at a word within `limit` characters ("..." marks
    a cut): torch's messages run long, and a cut mid-word read as a typo."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    if len(line) <= limit:
        return line.rstrip(".")
    return line[:limit].rsplit(" ", 1)[0].rstrip(" ,;:.") + "..."


def _culprit_sentence(progress: Progress | None, launcher: int | None) -> str:
    """Who to look at after a failed transfer or collective (see watchdog.culprits)."""
    if launcher is not None and process_gone(launcher):
        return LauncherGone.sentence(launcher)
    late = progress.culprits() if progress is not None else ""
    if late:
        return f"The process to look at: {late}"
    return ("Another process of the job stopped, died or stalled (the launcher names the "
            "one that failed first)")
