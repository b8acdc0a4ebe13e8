"""`partita train` under torchrun's agent, where partita's launcher is not there: every
rank refuses what would fail, a stop and a resume, and a finished process that waits for
the others and ends the job when one of them is stopped or hung."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from partita.testing import free_port
from tests.e2e.test_launch_faults import SMALL

pytestmark = pytest.mark.fault_suite("launch and signals")


def _torchrun(tmp_path) -> list[str]:
    """`torchrun --nproc-per-node 2 -m partita.cli` on a free port, as a user runs it,
    its agent's log folders kept under `tmp_path` (torchrun's default leaves one in the
    system's temporary folder per job)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            f"--master-port={free_port()}", f"--log-dir={tmp_path / 'torchrun-logs'}",
            "-m", "partita.cli"]


def test_a_layout_that_does_not_fit_torchruns_world_is_refused_by_every_rank(tmp_path):
    """Under torchrun only rank 0 checked the layout: rank 1 waited in the process
    group's rendezvous until torchrun killed it (38 s), the message pointed at
    partita train's --nproc (ignored under torchrun), and a checkpoints/ folder was
    left behind."""
    start = time.monotonic()
    done = subprocess.run(
        [*_torchrun(tmp_path), "train", *SMALL,
         "--parallel.tp=4", f"--train.out_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.count("partita: error: tp*pp*cp=4 does not divide the world size "
                             "2") == 1, done.stderr[-3000:]
    assert "torchrun's --nproc-per-node x --nnodes = 4" in done.stderr
    assert time.monotonic() - start < 30  # no rank waits for the one that refused
    assert not (tmp_path / "run").exists()


def test_a_cpu_job_too_large_for_the_machine_is_refused_under_torchrun_too(tmp_path):
    """The host memory check ran in partita's own launcher only: under torchrun a
    model far beyond the machine started, grew, and met the out-of-memory killer."""
    start = time.monotonic()
    done = subprocess.run(
        [*_torchrun(tmp_path), "train",
         "--model.name=llama3-8b", "--train.device=cpu", f"--train.out_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    # Said once, by the node's first process, with both processes counted.
    assert done.stderr.count("partita: error: this job needs about") == 1, done.stderr[-3000:]
    assert "for its 2 processes" in done.stderr
    assert "--train.host_memory_check=false" in done.stderr
    assert "SIGKILL" not in done.stderr
    assert time.monotonic() - start < 60  # refused before any rank builds the model
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("launcher", ["partita", "torchrun"])
def test_a_process_out_of_device_memory_is_told_what_would_fit(launcher, cache, tmp_path):
    """torch.OutOfMemoryError ended the job with "This is a fault inside partita, not in
    your settings" when it is the settings' to fix. (Injected: no GPU here; the device's
    size is then unknown, so the advice names what would lower the peak.)"""
    out = tmp_path / "run"
    args = ["train", *SMALL, f"--data.cache_dir={cache}", "--train.steps=4",
            f"--train.out_dir={out}"]
    command = ([sys.executable, "-m", "partita.cli", *args] if launcher == "partita" else
               [*_torchrun(tmp_path), *args])
    done = subprocess.run(command, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONUNBUFFERED": "1",
                               "PARTITA_FAULT": "rank=1,step=2,at=backward,do=oom"})
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines()
            if "process 1 ran out of device memory" in line]
    assert len(said) == 1, done.stderr[-3000:]
    assert "of step 2 (CUDA out of memory. Tried to allocate 2.00 GiB" in said[0]
    assert "The planner expects one process of this layout to hold about" in said[0]
    assert "It would hold less with --train.microbatches=2" in said[0]
    assert "fault inside partita" not in done.stderr
    if launcher == "partita":  # torchrun prints its own traceback for any failed worker
        assert "Traceback" not in done.stderr
    assert not (out / "model.safetensors").exists()


def test_a_job_under_torchrun_stops_resumes_and_exports(cache, tmp_path):
    """The whole job under torchrun's agent, whose store outlives the workers: a stop
    with a checkpoint (said once, not by every process), then a resume that trains on,
    exports, and exits 0 once the finished process has waited for process 0's export."""
    out = tmp_path / "run"

    def torchrun(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*_torchrun(tmp_path), "train", *SMALL,
             f"--data.cache_dir={cache}", "--train.steps=3", "--train.export=hf",
             f"--train.out_dir={out}", *args], capture_output=True, text=True, timeout=180)

    stopped = torchrun("--train.stop_after=2")
    assert stopped.returncode != 0  # torchrun reports its workers' exit 75 as a failure
    assert stopped.stderr.count("partita: stopped after step 2 with checkpoint") == 1, \
        stopped.stderr[-3000:]
    done = torchrun("--train.resume=auto")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: 3 steps" in done.stdout
    assert (out / "model.safetensors").exists() and (out / "hf" / "config.json").exists()


# What the finished process says of process 0, by the fault process 0 met in its export.
AT_THE_END = {
    "stop": "stopped responding (stopped, hung or dead; ended now if on this machine)",
    "hang": "made no progress (its heartbeat ran on, but its own threads used no CPU time "
            "and read or wrote nothing: hung in native code, on a lock or on a disk that "
            "does not answer; ended now)",
}


@pytest.mark.parametrize("fault", AT_THE_END)
def test_a_process_stuck_after_the_others_finished_ends_the_job_under_torchrun(
        cache, tmp_path, fault):
    """Process 0 stopped, or hung in native code with its heartbeat running on, while it
    exported the weights, after process 1 had finished: partita's launcher ends such a
    tail (`worker_watch`), but torchrun's agent waited for it without a bound. The
    finished process now waits for the others itself."""
    out = tmp_path / "run"
    start = time.monotonic()
    done = subprocess.run(
        [*_torchrun(tmp_path), "train", *SMALL,
         f"--data.cache_dir={cache}", "--train.steps=3", "--train.export=hf",
         "--train.collective_timeout_s=4", f"--train.out_dir={out}"],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONUNBUFFERED": "1",
             "PARTITA_FAULT": f"rank=0,step=3,at=export,do={fault}"})
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if line.startswith("partita: error:")]
    assert said == ["partita: error: process 1 finished, then waited for the others: rank 0 "
                    f"(last seen in step 3, export) {AT_THE_END[fault]} for "
                    "train.collective_timeout_s=4 s, so the job stops. Files it was writing "
                    "keep their temporary names; the ones named before it stopped are "
                    "complete."], done.stderr[-3000:]
    assert time.monotonic() - start < 120
    assert (out / "model.safetensors").exists()  # written before the export began
    assert not (out / "hf").exists()
