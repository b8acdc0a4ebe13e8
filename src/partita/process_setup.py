"""Setting up a rank's process: its device, its place in the world, its threads, and
telling a peer's failure from a fault of its own (used by the trainer and the CLI)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from partita.errors import PartitaError


def pick_device_name(name: str) -> str:
    """train.device resolved: "auto" is cuda when a GPU is visible, else cpu; "cuda" and
    "cuda:N" are checked against the GPUs visible (N counts them from 0)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    head, _, index = name.partition(":")
    if head != "cuda":
        return name
    if not torch.cuda.is_available():
        raise PartitaError(f"train.device={name} but no CUDA device is visible; use "
                           "train.device=cpu or auto.")
    gpus = torch.cuda.device_count()
    if index.isdigit() and int(index) >= gpus:
        valid = "cuda:0" if gpus == 1 else f"cuda:0 to cuda:{gpus - 1}"
        raise PartitaError(
            f"train.device={name} but {gpus} CUDA device(s) are visible ({valid}); give "
            "one of those, or train.device=cuda (each process of a node on its own GPU, "
            "by local rank). CUDA_VISIBLE_DEVICES chooses which GPUs are visible, and "
            "numbers them from 0."
        )
    return name


def pick_device(name: str) -> torch.device:
    """The rank's device: with "cuda", local rank r on GPU r; with "cuda:N", GPU N for
    the node's one process."""
    name = pick_device_name(name)
    if name.startswith("cuda"):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        check_local_processes(name, int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)))
        index = local_rank if name == "cuda" else int(name.partition(":")[2])
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(name)


def check_local_processes(name: str, local_processes: int) -> None:
    """Whether a node's `local_processes` fit the GPUs train.device=`name` (resolved by
    `pick_device_name`) gives them, one process per GPU: "cuda" gives local rank r GPU
    r; "cuda:N" gives every process GPU N, so it takes one process per node."""
    if name == "cuda":
        check_one_gpu_per_process(local_processes)
    elif name.startswith("cuda:") and local_processes > 1:
        raise PartitaError(
            f"train.device={name} puts all {local_processes} processes of this node on "
            "one GPU, and NCCL runs one process per GPU; use train.device=cuda (local "
            "rank r on GPU r; CUDA_VISIBLE_DEVICES chooses the GPUs) or --nproc 1."
        )


def check_one_gpu_per_process(local_processes: int) -> None:
    """NCCL takes one process per GPU (two on one GPU fail inside NCCL's setup with
    "Duplicate GPU detected"); say so before anything starts."""
    gpus = torch.cuda.device_count()
    if local_processes > gpus:
        raise PartitaError(
            f"{local_processes} processes on this node but {gpus} GPU(s) visible; NCCL "
            f"runs one process per GPU. Use --nproc {gpus} (or fewer), make more GPUs "
            "visible (CUDA_VISIBLE_DEVICES), or train on CPU processes with "
            "--train.device=cpu."
        )


def init_distributed(device: torch.device, timeout_s: float) -> tuple[int, int]:
    """Join the world torchrun (or our launcher) described in the environment."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if attempt == 0:
        dist.init_process_group(backend, timeout=timeout)
    else:
        # A restarted job meets in the same key-value store as the attempt before it,
        # where that attempt's addresses still stand (the new processes would read
        # them and fail to connect): each attempt keeps to keys of its own.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              world, is_master=rank == 0 and not hosted, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store),
                                rank=rank, world_size=world, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


# What gloo and NCCL say when a peer is gone or late (their errors are RuntimeErrors
# with these words rather than one exception type).
_PEER_FAILURE_WORDS = ("timed out", "application timeout", "pair closure",
                       "connection closed", "connection reset",
                       "broken pipe", "connection refused", "read error", "peer",
                       "nccl communicator was aborted")


def is_peer_failure(exc: BaseException) -> bool:
    """True when `exc` says a collective failed because another process did."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(word in text for word in _PEER_FAILURE_WORDS)


def default_threads() -> int:
    """Share the machine's cores among the local ranks (at least one thread each)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, (os.cpu_count() or 1) // local)
