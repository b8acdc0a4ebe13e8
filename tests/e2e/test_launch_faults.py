"""Launch-time faults end with one message within a bound, never a silent wait: a missing
node, out-of-range settings and sizes, Ctrl-C and SIGTERM, a folder of another run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from partita.testing import free_port

pytestmark = pytest.mark.fault_suite("launch and signals")


@pytest.fixture(scope="module")
def rendezvous_failures(tmp_path_factory) -> dict:
    """Both rendezvous-timeout jobs, started together: each spends most of its time
    waiting out its own timeout, so they overlap, and each test checks its own."""
    tmp = tmp_path_factory.mktemp("rendezvous")
    start = time.monotonic()
    alone = subprocess.Popen(
        [sys.executable, "-m", "partita.cli", "train", "--nproc", "1", "--nnodes", "2",
         "--rdzv-timeout", "5", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=alone",
         "--data.max_bytes=100000", f"--data.cache_dir={tmp / 'alone-cache'}",
         f"--train.out_dir={tmp / 'alone'}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    # The node hosting the rendezvous counts who had joined; a node whose host gave up
    # first says the rendezvous failed.
    common = [sys.executable, "-m", "partita.cli", "train", "--nproc", "1", "--nnodes", "3",
              "--rdzv-timeout", "6", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
              "--rdzv-id=two-of-three", "--train.global_batch=12", "--data.max_bytes=100000",
              f"--data.cache_dir={tmp / 'cache'}"]
    nodes = []
    for i in range(2):
        nodes.append(subprocess.Popen([*common, f"--train.out_dir={tmp / str(i)}"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
        time.sleep(1.5)  # the first one hosts the rendezvous
    errors = [node.communicate(timeout=120)[1] for node in nodes]
    alone_err = alone.communicate(timeout=120)[1]
    alone_elapsed = time.monotonic() - start  # at most: it may have ended before the nodes
    return {"alone": (alone.returncode, alone_err, alone_elapsed),
            "two of three": ([node.returncode for node in nodes], errors)}


def test_a_missing_node_stops_the_job_after_the_rendezvous_timeout(rendezvous_failures):
    returncode, err, elapsed = rendezvous_failures["alone"]
    assert returncode == 2, err[-2000:]
    assert "did not all join the rendezvous" in err
    assert "(at least 1 of 2 had joined)" in err
    assert "Traceback" not in err
    assert elapsed < 90


def test_two_of_three_nodes_say_so_and_the_other_stops_cleanly(rendezvous_failures):
    """The node hosting the rendezvous counts who had joined; a node whose host gave up
    first says the rendezvous failed. One paragraph each, no traceback."""
    returncodes, errors = rendezvous_failures["two of three"]
    assert all(code == 2 for code in returncodes), errors
    assert "(at least 2 of 3 had joined)" in errors[0], errors[0]
    assert all("Traceback" not in err for err in errors), errors


@pytest.mark.parametrize("setting", [
    "--train.steps=0", "--train.steps=-3", "--train.lr=-0.1", "--train.grad_clip=-1",
    "--train.beta1=1.5", "--train.microbatches=0", "--train.eval_every=0",
    "--train.log_every=0", "--model.dropout=2.0", "--train.threads=-1",
    "--train.collective_timeout_s=0", "--train.device=tpu",
])
def test_nonsense_is_refused_before_launch(cli, setting, tmp_path):
    result = cli("train", setting, f"--train.out_dir={tmp_path / 'run'}", timeout=60)
    assert result.returncode == 2
    assert setting.split("=")[0].lstrip("-") in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags", [["--nproc", "0"], ["--nproc", "-2"], ["--nnodes", "0"],
                                   ["--rdzv-timeout", "0"]])
def test_launcher_counts_out_of_range_are_refused(cli, flags, tmp_path):
    result = cli("train", *flags, f"--train.out_dir={tmp_path / 'run'}", timeout=60)
    assert result.returncode == 2
    assert flags[0] in result.stderr and "Traceback" not in result.stderr


SMALL = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--data.seq_len=32",
         "--data.max_bytes=200000", "--train.global_batch=4", "--train.threads=1",
         "--metrics.tensorboard=false", "--train.log_every=1", "--train.progress=false"]


def _endless_run(run, cache, nproc: int = 2, nohup: bool = False) -> subprocess.Popen:
    """A `partita train` of the small model that would run for hours, in a session of
    its own (so a test can signal its whole process group); `nohup`: started with
    SIGHUP ignored, as `nohup` starts it."""
    return subprocess.Popen(
        [sys.executable, "-m", "partita.cli", "train", *SMALL, "--nproc", str(nproc),
         "--train.steps=100000", f"--data.cache_dir={cache}", f"--train.out_dir={run}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if nohup else None)


def _wait_for_a_logged_step(run, within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and metrics.read_text().strip():
            return
        time.sleep(0.2)
    pytest.fail("training did not start")


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 75)])
def test_a_signal_stops_every_rank_with_one_line(sig, code, tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) ends the job
    with the shell's status, one line, no traceback; SIGTERM to every process (as a
    scheduler sends it: the launcher's forwarded copy arrives too, and counts once)
    finishes the step, writes a checkpoint and exits with 75."""
    run = tmp_path / "run"
    proc = _endless_run(run, tmp_path / "cache")
    try:
        _wait_for_a_logged_step(run)
        os.killpg(proc.pid, sig)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "death signal" not in err, err[-3000:]  # torch's agent kept quiet
    if sig == signal.SIGTERM:
        assert "stopped after step" in err and "--train.resume=auto" in err, err[-3000:]
        assert (run / "checkpoints" / "latest").exists()
    else:
        assert f"stopped by {signal.Signals(sig).name}" in err
    assert not list(run.glob("*.partial")) and not (run / "model.safetensors").exists()


def test_a_job_started_under_nohup_trains_on_when_its_terminal_closes(tmp_path):
    """`nohup partita train ... &`, then the terminal closes (SIGHUP to the group): the
    launcher's agent and the workers set their own SIGHUP handlers, and the job stopped
    (exit 129). It trains on now; a SIGTERM then stops it as usual."""
    run = tmp_path / "run"
    proc = _endless_run(run, tmp_path / "cache", nohup=True)
    try:
        _wait_for_a_logged_step(run)
        os.killpg(proc.pid, signal.SIGHUP)
        logged = len((run / "metrics.jsonl").read_text().splitlines())
        deadline = time.monotonic() + 60
        while len((run / "metrics.jsonl").read_text().splitlines()) < logged + 5:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no step after the SIGHUP"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, err[-3000:]
    assert "SIGHUP" not in err and "Traceback" not in err, err[-3000:]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="reads /proc/PID/task/PID/children")
@pytest.mark.parametrize("command", ["train", "bench"])
def test_ctrl_c_while_the_worker_server_imports_says_one_line(command, tmp_path):
    """Ctrl-C in the first seconds of a run reaches the fork server the workers come from
    while it imports (torch for `bench`; partita's modules for `train`, whose server is
    a fork of the launcher made once torch is imported). It used to die there of a
    KeyboardInterrupt and print the import's traceback under partita's own line (9 of
    30 Ctrl-Cs sent at random 0.3-6 s
    into `partita train`, 3 of 12 into `partita bench dp`); now it ignores Ctrl-C from
    its start, as it does after its imports, and is stopped with the command. A worker
    `bench` had asked for and the server started after the command left printed a
    traceback about the command's vanished queue (7 of 20 once the server survived
    Ctrl-C); the command now stops the server first."""
    if command == "train":
        proc = _endless_run(tmp_path / "run", tmp_path / "cache")
    else:
        proc = subprocess.Popen(
            [sys.executable, "-m", "partita.cli", "bench", "dp", "--rounds", "1",
             "--max-rounds", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        server = None
        while server is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                launcher = open(f"/proc/{proc.pid}/cmdline", "rb").read()
            for child in _children(proc.pid):
                with contextlib.suppress(OSError):
                    cmdline = open(f"/proc/{child}/cmdline", "rb").read()
                    # A spawned server names itself; a forked one has the launcher's line.
                    if b"forkserver" in cmdline or cmdline == launcher:
                        server = child
            time.sleep(0.01)
        assert server is not None, "the worker server did not start"
        os.killpg(proc.pid, signal.SIGINT)  # its imports take seconds: it is inside them
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "stopped by SIGINT" in err, err[-3000:]
    # Nothing of the command left running (an orphaned server would leave only once its
    # imports were done).
    assert not _running(server), f"the fork server (pid {server}) outlived the command"


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("nproc", [1, 2])
def test_workers_of_a_killed_launcher_stop_and_say_why(nproc, tmp_path):
    """SIGKILL to the launcher alone (the out-of-memory killer, `kill -9`): its workers
    must not train on unattended; each stops within a bound with one line naming the
    lost launcher and how to continue, without native stack frames or a traceback.
    Two processes notice in their next collective (the launcher held their store); one
    process, which has no collectives, checks on its launcher (`LauncherWatch`)."""
    run = tmp_path / "run"
    proc = _endless_run(run, tmp_path / "cache", nproc)
    try:
        _wait_for_a_logged_step(run)
        os.kill(proc.pid, signal.SIGKILL)
        # stderr closes once every process holding it, the workers included, has exited
        _out, err = proc.communicate(timeout=90)
    finally:  # whatever of the job is left
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert f"auncher that started this process (pid {proc.pid}) is gone" in err, err[-3000:]
    assert "--train.resume=auto" in err
    assert "Traceback" not in err and "frame #" not in err, err[-3000:]
    # the standard library's tracker unlinks the semaphores the launcher left, quietly
    assert "leaked semaphore" not in err, err[-3000:]


def _catches_sigterm(pid: int) -> bool:
    """Whether process `pid` has a SIGTERM handler (Linux: SigCgt in /proc/PID/status)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
@pytest.mark.parametrize("after_s", [0.0, 0.5, 1.5])
def test_a_sigterm_while_the_job_starts_is_a_stop_on_request(after_s, tmp_path):
    """A scheduler's SIGTERM during start-up (before the workers exist, while they import,
    while the trainer sets up) ends the job as a stop on request, exit 75, never as a
    failure (143) and never lost (the job training on to its end, as one 2.6-2.9 s in
    did before the launcher left the request as a file for workers that missed it)."""
    run = tmp_path / "run"
    proc = _endless_run(run, tmp_path / "cache")
    try:
        deadline = time.monotonic() + 60  # from when the command line takes signals
        while not _catches_sigterm(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(after_s)
        os.kill(proc.pid, signal.SIGTERM)  # the launcher only, as `kill PID` does
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # Stopped before its first step, or, where start-up was quicker than the delay (or a
    # worker missed the signal and read the launcher's file), after a step, with its
    # checkpoint: either way a stop on request.
    assert ("before the first step" in err or
            ("stopped after step " in err and (run / "checkpoints" / "latest").exists())), \
        err[-3000:]
    assert not list(run.glob("*.partial")) and not (run / "model.safetensors").exists()


# Sends itself a SIGTERM while the command line builds its parser (the commands'
# imports: about two seconds for `train`), then goes on as `partita` would.
_SIGTERM_WHILE_PARSING = """
import os, signal, sys
import partita.cli as cli
real = cli.build_parser
def build_parser(*args):
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args)
cli.build_parser = build_parser
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command,status,said", [
    (["train", "--train.steps=1"], 75, "partita: stopped by SIGTERM before the first step"),
    (["plan", "--model", "tiny", "--gpus", "2"], 143,
     "partita: stopped by SIGTERM; every process was stopped."),
])
def test_a_sigterm_while_the_command_line_is_read_is_reported(command, status, said, tmp_path):
    """It ended the process without a word (the default action, 143) before the
    command's handler was in place."""
    result = subprocess.run([sys.executable, "-c", _SIGTERM_WHILE_PARSING, *command],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == status, (result.returncode, result.stderr[-2000:])
    assert said in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


def test_a_used_out_dir_is_refused_unless_overwrite(cli, tmp_path):
    run = tmp_path / "run"
    (run).mkdir()
    (run / "model.safetensors").write_bytes(b"previous run")
    args = ["train", *SMALL, "--nproc", "1", "--train.steps=2",
            f"--data.cache_dir={tmp_path / 'cache'}", f"--train.out_dir={run}"]
    refused = cli(*args)
    assert refused.returncode == 2 and "already holds another run's results" in refused.stderr
    assert (run / "model.safetensors").read_bytes() == b"previous run"
    # A run without checkpoints cannot be resumed: said as such, not "use resume=auto".
    auto = cli(*args, "--train.resume=auto")
    assert auto.returncode == 2, auto.stderr[-2000:]
    assert "train.resume=auto found no checkpoint of the run" in auto.stderr, auto.stderr
    assert "--model.init_from=DIR" in auto.stderr
    assert (run / "model.safetensors").read_bytes() == b"previous run"
    replaced = cli(*args, "--train.overwrite=true")
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    assert (run / "model.safetensors").read_bytes() != b"previous run"


@pytest.mark.parametrize("args", [
    ["plan", "--model", "llama3-70b", "--gpus", "100000000"],
    ["plan", "--model", "llama3-70b", "--gpus", "0"],
    ["plan", "--model", "llama3-70b", "--gpus", "8", "--global-batch", "-4"],
    ["plan", "--model", "llama3-70b", "--gpus", "8", "--seq-len", "0"],
    ["schedule", "gpipe", "--stages", "100000", "--microbatches", "100000"],
    ["schedule", "1f1b", "--stages", "0", "--microbatches", "4"],
    ["schedule", "interleaved-1f1b", "--stages", "64", "--microbatches", "64", "--virtual", "8"],
])
def test_sizes_beyond_the_stated_limits_are_refused_at_once(cli, args):
    start = time.monotonic()
    result = cli(*args, timeout=60)
    assert result.returncode == 2 and "is out of range" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - start < 30  # an import of torch at most, no search


def test_a_cpu_process_whose_allocation_fails_is_told_what_the_machine_holds(cache, tmp_path):
    """torch's CPU allocator failing (a tensor larger than the machine can give) read as
    a fault of partita's too."""
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "partita.cli", "train", *SMALL, f"--data.cache_dir={cache}",
         "--train.steps=4", f"--train.out_dir={out}"],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONUNBUFFERED": "1",
             "PARTITA_FAULT": "rank=0,step=2,at=forward,do=host_oom"})
    assert done.returncode == 2, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "process 0 ran out of memory" in line]
    assert len(said) == 1, done.stderr[-3000:]
    assert "(DefaultCPUAllocator: can't allocate memory: you tried to allocate" in said[0]
    assert "alloc_cpu.cpp" not in said[0]
    assert "The planner expects this machine's 2 process(es) to hold about" in said[0]
    assert "fault inside partita" not in done.stderr and "Traceback" not in done.stderr
