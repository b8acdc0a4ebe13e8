"""Process faults injected into real `partita train` jobs end them within a bound.

Each case kills (SIGKILL), stops (SIGSTOP) or makes raise (and in two cases hang in
native code) one rank at one point of a step, under one of four layouts (dp, ZeRO-3,
tp, pp). Every (fault, point) pair runs once, the layouts taking turns, so each layout
meets every kind of fault; a pipeline's sends and receives are two more points, under
the pp layout. Each case asserts a non-zero exit within the bound, messages without a
traceback, the last message naming the process that failed first (and, for a stopped
or hung one, the others naming it as behind), and no weights or half-written file left
in the run folder.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from partita.faults import INJECTED, KINDS, PIPELINE_POINTS, POINTS

pytestmark = pytest.mark.fault_suite("process faults")

TIMEOUT_S = 4  # collective and pipeline timeouts of these jobs
SLOW_TIMEOUT_S = 12  # the same, for a job rerun because it failed before its fault
BOUND_S = 150  # start-up of two processes on a loaded 2-core machine included
CONCURRENT = 3  # jobs at once (see `outcomes`)

LAYOUTS = {
    "dp": [],
    "zero3": ["--parallel.zero_stage=3"],
    "tp": ["--parallel.tp=2", "--parallel.sequence_parallel"],
    "pp": ["--parallel.pp=2", "--train.microbatches=2"],
}
SMALL = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--data.seq_len=32",
         "--data.max_bytes=200000", "--train.global_batch=4", "--train.threads=1",
         "--metrics.tensorboard=false", "--train.progress=false", "--train.eval_every=1000"]


def _cases() -> list[tuple[str, str, str, int]]:
    layouts = itertools.cycle(LAYOUTS)
    cases = []
    for i, (kind, point) in enumerate(itertools.product(KINDS, POINTS)):
        cases.append((next(layouts), kind, point, i % 2))
    # A pipeline's own transfers: each fault at a send and at a receive.
    for i, (kind, point) in enumerate(itertools.product(KINDS, PIPELINE_POINTS)):
        cases.append(("pp", kind, point, i % 2))
    # A process with no part of the weights to send, stopped while rank 0 writes them:
    # rank 0 finished, and the job waited for the stopped one forever.
    cases.append(("dp", "stop", "weight_write", 1))
    # Process 0 stopped while it exports the written weights (train.export), the others
    # finished: nothing waited on it, and the job waited forever; the launcher ends it.
    cases.append(("dp", "stop", "export", 0))
    # The same, hung in native code rather than stopped: its heartbeat runs on and it
    # does nothing, which the launcher tells from its threads' CPU time and I/O.
    cases.append(("dp", "hang", "export", 0))
    # Hung inside a step: the others' collectives time out and they name it, as for a
    # stopped one, though its heartbeat runs on.
    cases.append(("zero3", "hang", "backward", 1))
    return cases


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stderr: str
    elapsed: float
    run: Path


def _run_case(case: tuple[str, str, str, int], root: Path, cache: str) -> Outcome:
    """One job with the fault; again with longer timeouts if it failed before the fault
    was due (the machine so loaded that a rank fell TIMEOUT_S behind in an earlier
    step): that run tested nothing about the fault."""
    outcome = _job(case, root, cache, TIMEOUT_S)
    if INJECTED not in outcome.stderr:
        outcome = _job(case, root, cache, SLOW_TIMEOUT_S)
    return outcome


def _job(case: tuple[str, str, str, int], root: Path, cache: str, timeout_s: int) -> Outcome:
    layout, kind, point, rank = case
    steps = 3
    step = steps if point in ("weight_write", "export") else 2
    export = ["--train.export=hf"] if point == "export" else []
    run = root / f"{layout}-{kind}-{point}-{rank}-{timeout_s}s"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PARTITA_FAULT": f"rank={rank},step={step},at={point},do={kind}"}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "partita.cli", "train", *SMALL, *LAYOUTS[layout], *export,
         "--nproc", "2",
         f"--train.steps={steps}", f"--data.cache_dir={cache}", f"--train.out_dir={run}",
         f"--train.collective_timeout_s={timeout_s}", f"--parallel.pp_timeout_s={timeout_s}"],
        capture_output=True, text=True, timeout=BOUND_S + 60, env=env)
    return Outcome(result.returncode, result.stderr, time.monotonic() - start, run)


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory, cache) -> dict:
    """Every selected case's job, run CONCURRENT at a time: most of a case is
    process start-up and waiting out a timeout, so overlapping them keeps the suite
    short; each case still runs its own job and is checked on its own."""
    selected = [item.callspec.params for item in request.session.items
                if item.originalname == "test_a_faulty_rank_ends_the_job_with_a_clear_message"]
    cases = [(p["layout"], p["kind"], p["point"], p["rank"]) for p in selected]
    root = tmp_path_factory.mktemp("faults")
    with ThreadPoolExecutor(CONCURRENT) as pool:
        futures = {case: pool.submit(_run_case, case, root, cache) for case in cases}
        return {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize(("layout", "kind", "point", "rank"), _cases(),
                         ids=[f"{lay}-{k}-{p}-rank{r}" for lay, k, p, r in _cases()])
def test_a_faulty_rank_ends_the_job_with_a_clear_message(layout, kind, point, rank, outcomes):
    result = outcomes[(layout, kind, point, rank)]
    err = result.stderr
    assert INJECTED in err, err[-3000:]  # the job reached its fault
    assert result.returncode != 0, err[-3000:]
    assert result.elapsed < BOUND_S, result.elapsed
    assert "Traceback" not in err, err[-3000:]
    last = [line for line in err.splitlines() if line.startswith("partita:")][-1]
    assert last.startswith("partita: error: process "), last
    stuck = kind in ("stop", "hang")
    if stuck and point not in ("weight_write", "export"):  # the waiting ranks name it
        assert f"The process to look at: rank {rank} " in err, err[-3000:]
    if not stuck:  # the faulty process is the first to fail
        assert f"process {rank} of the job" in last, last
    if point == "export":  # the launcher ends the last process; the weights were complete
        what = "was stopped (SIGSTOP)" if kind == "stop" else "made no progress for"
        assert f"partita: process {rank} (pid " in err and what in err, err[-3000:]
        assert f"process {rank} of the job" in last, last
        assert (result.run / "model.safetensors").exists()
        assert not (result.run / "hf").exists()
    else:
        assert not (result.run / "model.safetensors").exists()
    assert not list(result.run.glob("*.partial"))


def test_a_stalled_step_is_reported_before_the_timeout(tmp_path, cache):
    """Rank 0's watchdog names the stopped rank once the step runs stall_warning_factor
    times the median step time, seconds before the collective timeout ends the job."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PARTITA_FAULT": "rank=1,step=4,at=forward,do=stop"}
    settings = [s for s in SMALL if "timeout_s" not in s]
    # The warning comes after max(3 x median step, 2 s) and the 1.5 s silence probe,
    # about 4 s into the stall; a 10 s timeout leaves room on a loaded machine.
    result = subprocess.run(
        [sys.executable, "-m", "partita.cli", "train", *settings, "--nproc", "2",
         "--train.steps=6", "--train.collective_timeout_s=10", "--train.stall_warning_factor=3",
         f"--data.cache_dir={cache}", f"--train.out_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=BOUND_S + 60, env=env)
    err = result.stderr
    assert result.returncode != 0
    warning = [line for line in err.splitlines() if line.startswith("partita: warning: step 4")]
    assert warning, err[-3000:]
    assert "rank 1 (last seen in step 4" in warning[0] and "stopped responding" in warning[0]
    assert err.index(warning[0]) < err.index("partita: error")
