"""Start N local processes (one node of a possibly multi-node job) with torch's elastic
launcher — the machinery behind `torchrun` — and run a function on each.

Under `torchrun` or Slurm the environment already describes the world (RANK,
WORLD_SIZE, MASTER_ADDR, ...); then partita runs the function directly in the current
process and this module is not used.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from partita.errors import PartitaError


@dataclass(frozen=True)
class LaunchSpec:
    nproc: int = 1  # processes on this node
    nnodes: int = 1
    rdzv_endpoint: str = ""  # host:port every node can reach; "" = this machine, free port
    rdzv_id: str = ""  # shared by the nodes of one job; "" = a fresh id (single node)
    max_restarts: int = 0


def launched_externally() -> bool:
    """True under torchrun / Slurm-with-torchrun / our own launcher's children."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(spec: LaunchSpec, fn: Callable, *args) -> list:
    """Run fn(*args) on spec.nproc local processes; return their results by local rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from partita.local_world import free_port

    if spec.nnodes > 1 and not (spec.rdzv_endpoint and spec.rdzv_id):
        raise PartitaError(
            f"--nnodes {spec.nnodes} needs --rdzv-endpoint HOST:PORT (an address of one "
            "node that every node can reach) and the same --rdzv-id on every node."
        )
    config = LaunchConfig(
        min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc,
        run_id=spec.rdzv_id or uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint=spec.rdzv_endpoint or f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": 120},
        max_restarts=spec.max_restarts, monitor_interval=0.2, start_method="spawn",
    )
    # The agent logs each failed child with a long record; the child has already printed
    # its own message (a one-paragraph PartitaError or a traceback), which is the one
    # worth reading, so keep the agent to critical messages.
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, _run_reporting_errors)(fn, *args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise PartitaError(
            f"process {rank} of the job stopped with exit code {failure.exitcode}; its "
            "message is printed above. The other processes were stopped."
        ) from None
    return [results[r] for r in sorted(results)]


def _run_reporting_errors(fn: Callable, *args):
    """A launched process's entry: an exception it does not handle is printed here,
    with the process's rank, before the process dies. (The elastic agent files it in
    an error record that nothing shows, which left the parent pointing at a message
    no one printed.) Functions that print their own message exit via SystemExit."""
    try:
        return fn(*args)
    except Exception:
        rank = os.environ.get("RANK", "?")
        print(f"partita: process {rank} failed:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        raise
