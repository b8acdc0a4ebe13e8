"""Checkpoints from the command line: stop and resume anywhere, in any layout; survive
SIGTERM, a killed worker (--max-restarts), a writer killed mid-save and a full disk.

The runs train in float64 on the tiny model (8 steps, a checkpoint every 2), so a run
that was interrupted and resumed must end on exactly the losses of one that was not:
bitwise in the same layout, within 1e-10 relative after a reshard.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from partita.errors import CHECKPOINT_STOP_EXIT
from partita.testing import FLOAT64_TOL, relative_error

pytestmark = pytest.mark.fault_suite("checkpoints")

STEPS = 8
F64 = ("--train.dtype=float64", f"--train.steps={STEPS}", "--train.checkpoint_every=2",
       "--train.eval_every=100", "--train.collective_timeout_s=20")


def _losses(out: Path) -> dict[int, float]:
    """step -> loss of a run's metrics (the last record wins: a resumed run rewrites)."""
    out_losses = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and "step" in record:
            out_losses[record["step"]] = record["loss"]
    return out_losses


DROPOUT = ("--nproc", "1", "--model.dropout=0.1", "--train.dtype=float64",
           "--train.steps=5", "--train.eval_every=100")
CONCURRENT = 3  # jobs at once (see `jobs`)


def _fault_env(fault: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PARTITA_FAULT": fault}


# The first run of each test that starts from nothing: (arguments after `train`'s own,
# the injected fault or "").
JOBS = {
    "whole": (("--nproc", "2", *F64), ""),
    "stop after 3": (("--nproc", "2", *F64, "--parallel.zero_stage=3", "--train.stop_after=3"),
                     ""),
    "dropout whole": (DROPOUT, ""),
    "dropout part": ((*DROPOUT, "--train.stop_after=3"), ""),
    "killed worker": (("--nproc", "2", "--max-restarts", "1", *F64),
                      "rank=1,step=5,at=forward,do=kill"),
    "killed writer": (("--nproc", "2", *F64, "--train.async_checkpoint=false"),
                      "rank=1,step=4,at=checkpoint_write,do=kill"),
    "full disk stop": (("--nproc", "2", *F64, "--train.steps=6",
                        "--train.checkpoint_failure=stop"),
                       "rank=0,step=4,at=checkpoint_write,do=enospc"),
    "full disk continue": (("--nproc", "2", *F64, "--train.steps=6",
                            "--train.checkpoint_failure=continue"),
                           "rank=0,step=4,at=checkpoint_write,do=enospc"),
    "failed last save": (("--nproc", "2", *F64, "--train.steps=6",
                          "--train.checkpoint_failure=continue"),
                         "rank=0,step=6,at=checkpoint_write,do=enospc"),
    "hung writer": (("--nproc", "2", "--train.steps=6", "--train.checkpoint_every=2",
                     "--train.eval_every=100", "--train.collective_timeout_s=6"),
                    "rank=0,step=2,at=checkpoint_write,do=hang"),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, cache) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every test's first run, CONCURRENT at a time: each is process start-up, a few
    tiny steps and, for the faults, waiting for the job to notice and end, so they
    overlap; each still runs on its own folder and is checked by its own test."""
    from tests.conftest import CLI

    cli = CLI(cache)
    root = tmp_path_factory.mktemp("jobs")

    def run(name: str) -> tuple[subprocess.CompletedProcess, Path]:
        args, fault = JOBS[name]
        out = root / name.replace(" ", "-") / "run"
        result = subprocess.run([sys.executable, "-m", "partita.cli",
                                 *cli.train_args(out, *args)],
                                capture_output=True, text=True, timeout=300,
                                env=_fault_env(fault) if fault else
                                {**os.environ, "PYTHONUNBUFFERED": "1"})
        return result, out

    with ThreadPoolExecutor(CONCURRENT) as pool:
        futures = {name: pool.submit(run, name) for name in JOBS}
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def whole_run(jobs) -> Path:
    """A run that was not interrupted (its checkpoints serve the bad-input cases)."""
    result, out = jobs["whole"]
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(_losses(out)) == list(range(1, STEPS + 1))
    return out


@pytest.fixture(scope="module")
def uninterrupted(whole_run) -> dict[int, float]:
    return _losses(whole_run)


def _same(got: dict[int, float], want: dict[int, float], tol: float = 0.0) -> None:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for step in want:
        if tol == 0.0:
            assert got[step] == want[step], (step, got[step], want[step])
        else:
            assert relative_error(got[step], want[step]) <= tol, (step, got[step], want[step])


def test_stop_after_then_resume_in_another_layout(jobs, cli, uninterrupted):
    result, run_dir = jobs["stop after 3"]
    assert result.returncode == CHECKPOINT_STOP_EXIT, result.stderr[-2000:]
    assert "stopped after step 3" in result.stderr and "--train.resume=auto" in result.stderr
    assert not (run_dir / "model.safetensors").exists()
    hf = cli("export", str(run_dir), "--format", "hf", "--out", str(run_dir / "hf"))
    assert hf.returncode == 0 and (run_dir / "hf" / "config.json").exists(), hf.stderr
    # a fresh run may not take over the folder of a run that can continue
    again = cli.train(run_dir, "--nproc", "2", *F64)
    assert again.returncode == 2 and "--train.resume=auto" in again.stderr
    # 2 processes -> 1 (ZeRO-3 to none), to the end
    result = cli.train(run_dir, "--nproc", "1", *F64, "--train.resume=auto")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resharded into this layout" in result.stdout
    _same(_losses(run_dir), uninterrupted, FLOAT64_TOL)
    info = cli("checkpoint", "info", str(run_dir))
    assert info.returncode == 0 and f"step {STEPS}" in info.stdout and "1 process" in info.stdout
    exported = cli("checkpoint", "export", str(run_dir), "--out", str(run_dir / "w.safetensors"))
    assert exported.returncode == 0, exported.stderr
    assert (run_dir / "w.safetensors").stat().st_size > 0
    # An existing file is replaced only when asked, as by `partita export`.
    again = cli("checkpoint", "export", str(run_dir), "--out", str(run_dir / "w.safetensors"))
    assert again.returncode == 2 and "--overwrite" in again.stderr, again.stderr
    again = cli("checkpoint", "export", str(run_dir), "--out", str(run_dir / "w.safetensors"),
                "--overwrite")
    assert again.returncode == 0, again.stderr


def test_a_dropout_run_resumed_in_its_layout_continues_bitwise(jobs, cli):
    """The restored random streams are the ones the dropout masks draw from: nothing
    the run does as it starts (measuring the CPU's rate for MFU) may draw from them."""
    (done, whole), (stopped, part) = jobs["dropout whole"], jobs["dropout part"]
    assert done.returncode == 0, done.stderr[-2000:]
    assert stopped.returncode == CHECKPOINT_STOP_EXIT, stopped.stderr[-2000:]
    resumed = cli.train(part, *DROPOUT, "--train.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "random streams restored" in resumed.stdout
    _same(_losses(part), _losses(whole))


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_exits_75(run_dir, cli):
    """SIGTERM lands whenever it lands; the ranks agree on the step to stop after."""
    proc = subprocess.Popen([sys.executable, "-m", "partita.cli",
                             *cli.train_args(run_dir, "--nproc", "2", *F64,
                                             "--train.steps=100000", "--train.warmup_steps=2")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "latest").exists():  # training is under way
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == CHECKPOINT_STOP_EXIT, err[-2000:]
    assert "Traceback" not in err
    stopped = int(err.split("stopped after step ")[1].split()[0])
    assert (run_dir / "checkpoints" / f"step-{stopped:08d}" / "manifest.json").exists()
    verify = cli("checkpoint", "verify", str(run_dir))
    assert verify.returncode == 0 and f"step-{stopped:08d}" in verify.stdout, verify.stderr


def test_a_killed_worker_is_restarted_and_the_run_finishes_alike(jobs, uninterrupted):
    result, run_dir = jobs["killed worker"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "step-00000004" in result.stdout
    _same(_losses(run_dir), uninterrupted)


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint(jobs, cli, uninterrupted):
    result, run_dir = jobs["killed writer"]
    assert result.returncode != 0
    root = run_dir / "checkpoints"
    assert not (root / "step-00000004").exists()
    assert (root / "latest").read_text().strip() == "step-00000002"
    verify = cli("checkpoint", "verify", str(root))
    assert verify.returncode == 0 and "step-00000002" in verify.stdout, verify.stderr
    result = cli.train(run_dir, "--nproc", "2", *F64, "--train.resume=auto")
    assert result.returncode == 0, result.stderr[-2000:]
    assert not list(root.glob("*.partial"))
    _same(_losses(run_dir), uninterrupted)


def test_a_writer_hung_in_native_code_is_named_by_the_others(jobs):
    """Rank 0's checkpoint writer blocks for good (a disk that does not answer): at the
    next checkpoint rank 0 waits for it while rank 1 goes on to the copy's collectives,
    which time out naming rank 0; no checkpoint of step 2 looks complete."""
    result, run_dir = jobs["hung writer"]
    assert result.returncode != 0
    assert "The process to look at: rank 0 (step 4, checkpoint wait) behind the others" \
        in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (run_dir / "checkpoints" / "step-00000002").exists()


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_full_disk_keeps_the_previous_checkpoint(policy, jobs):
    result, run_dir = jobs[f"full disk {policy}"]
    root = run_dir / "checkpoints"
    assert "No space left on device" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    assert not list(root.glob("*.partial"))
    assert not (root / "step-00000004").exists()
    if policy == "stop":
        assert result.returncode == 2, result.stderr[-2000:]
        assert "earlier checkpoints are intact" in result.stderr
        assert (root / "latest").read_text().strip() == "step-00000002"
    else:
        assert result.returncode == 0, result.stderr[-2000:]
        assert (root / "latest").read_text().strip() == "step-00000006"
        assert "partita: warning: a checkpoint could not be saved" in result.stdout


def test_a_failed_last_save_fails_the_run_even_when_saves_may_fail(jobs):
    """checkpoint_failure=continue trains on past a failed save, but no later save can
    replace the run's last one: exit 2, the newest intact checkpoint kept."""
    result, run_dir = jobs["failed last save"]
    root = run_dir / "checkpoints"
    assert result.returncode == 2, result.stderr[-2000:]
    assert "the run's last checkpoint could not be saved" in result.stderr, result.stderr
    assert "No space left on device" in result.stderr
    assert "redo the steps after the newest intact checkpoint" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(root.glob("*.partial"))
    assert (root / "latest").read_text().strip() == "step-00000004"


def test_bad_checkpoints_are_refused(tmp_path, run_dir, cli, whole_run):
    missing = cli.train(run_dir, "--nproc", "2", "--train.resume=/no/such/checkpoint")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    folder = whole_run / "checkpoints" / f"step-{STEPS:08d}"
    other = cli.train(run_dir, "--nproc", "2", *F64, f"--train.resume={folder}",
                      "--model.dim=64")
    assert other.returncode == 2 and "another model" in other.stderr
    assert "dim: checkpoint 32, this run 64" in other.stderr
    # Another sequence length cannot continue the data order: refused before launch.
    longer_seqs = cli.train(run_dir, "--nproc", "2", *F64, f"--train.resume={folder}",
                            "--data.seq_len=16")
    assert longer_seqs.returncode == 2, longer_seqs.stderr[-2000:]
    assert "partita: error: cannot resume the data sampler: the checkpoint has seq_len=32 " \
        "but this run has seq_len=16" in longer_seqs.stderr, longer_seqs.stderr[-2000:]
    # Other data (more of it): the windows are counted before launch, said once.
    more_data = cli.train(run_dir, "--nproc", "2", *F64, f"--train.resume={folder}",
                          "--data.max_bytes=400000")
    assert more_data.returncode == 2, more_data.stderr[-2000:]
    assert more_data.stderr.count("cannot resume the data sampler: the checkpoint has "
                                  "num_windows=") == 1, more_data.stderr[-2000:]
    assert "process 0 of the job" not in more_data.stderr
    # a damaged newest manifest: the older checkpoint is used, and said to be
    every = tmp_path / "every"
    shutil.copytree(whole_run / "checkpoints", every)
    (every / folder.name / "manifest.json").write_text('{"step": ')
    verify = cli("checkpoint", "verify", str(every))
    assert verify.returncode == 0, verify.stderr
    assert f"{folder.name} in {every} cannot be read" in verify.stderr, verify.stderr
    # a damaged shard: named, and nothing is trained
    copy = tmp_path / "damaged"
    shutil.copytree(folder, copy)
    shard = copy / "rank-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0xFF
    shard.write_bytes(bytes(data))
    longer = f"--train.steps={STEPS + 2}"
    damaged = cli.train(tmp_path / "r2", "--nproc", "2", *F64, longer, f"--train.resume={copy}")
    assert damaged.returncode != 0 and "rank-00001-of-00002.safetensors' is corrupt" in \
        damaged.stderr, damaged.stderr[-2000:]
    assert "Traceback" not in damaged.stderr
    assert not (tmp_path / "r2" / "model.safetensors").exists()
    # both files damaged: the job stops with one message, not one per process
    other = copy / "rank-00000-of-00002.safetensors"
    intact = other.read_bytes()
    other.write_bytes(intact[:-20] + bytes([intact[-20] ^ 0xFF]) + intact[-19:])
    both = cli.train(tmp_path / "r4", "--nproc", "2", *F64, longer, f"--train.resume={copy}")
    assert both.returncode == 2 and both.stderr.count("' is corrupt") == 1, \
        both.stderr[-2000:]
    other.write_bytes(intact)
    shard.write_bytes(bytes(data[:-100]))
    cut = cli.train(tmp_path / "r3", "--nproc", "2", *F64, longer, f"--train.resume={copy}")
    assert cut.returncode == 2 and "truncated" in cut.stderr, cut.stderr[-2000:]
    info = cli("checkpoint", "info", str(copy))  # the manifest's sizes, the file's, a warning
    assert info.returncode == 0 and "warning:" in info.stderr and "truncated" in info.stderr
    assert "rank-00001-of-00002.safetensors" in info.stdout and "(on disk: " in info.stdout
    shard.unlink()
    gone = cli.train(tmp_path / "r3", "--nproc", "2", *F64, longer, f"--train.resume={copy}")
    assert gone.returncode == 2 and "is missing" in gone.stderr, gone.stderr[-2000:]


def test_generate_samples_from_a_checkpoint_as_from_the_final_weights(tmp_path, whole_run):
    """`partita generate --run CHECKPOINT`: the model assembled from every rank's shards
    of the last checkpoint is the finished run's model, bit for bit; the newest of a
    folder of checkpoints is taken; a damaged shard is named."""
    import torch

    from partita.errors import PartitaError
    from partita.sampling import find_weights, generate_text, load_run_model

    folder = whole_run / "checkpoints" / f"step-{STEPS:08d}"
    assert find_weights(whole_run) == whole_run
    assert find_weights(whole_run / "checkpoints") == folder
    final, _ = load_run_model(whole_run)
    saved, cfg = load_run_model(folder)
    assert cfg.train.dtype == "float64"
    for (name, a), (_, b) in zip(final.state_dict().items(), saved.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert generate_text(folder, "def ", 8, temperature=0) == \
        generate_text(whole_run, "def ", 8, temperature=0)
    copy = tmp_path / "damaged"
    shutil.copytree(folder, copy)
    shard = copy / "rank-00000-of-00002.safetensors"  # rank 0 holds the ZeRO-0 weights
    data = bytearray(shard.read_bytes())
    for i in range(len(data) // 2, len(data), 4099):  # through every tensor after the middle
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(PartitaError, match="rank-00000-of-00002.safetensors' is corrupt"):
        load_run_model(copy)


def test_a_resume_with_nothing_left_to_train_ends_with_done_and_the_weights(tmp_path, cli,
                                                                             whole_run):
    """A restart after the last step's checkpoint (a failure in the final weight write,
    say) ended with a line that did not start with `done:`, which the README promises
    and scripts read."""
    from safetensors.torch import load_file

    out = tmp_path / "again"
    result = cli.train(out, "--nproc", "1", *F64, f"--train.resume={whole_run}/checkpoints")
    assert result.returncode == 0, result.stderr[-2000:]
    last = (result.stdout + result.stderr).strip().splitlines()[-1]
    assert last.startswith("done: the checkpoint is at step 8"), last
    mine, theirs = (load_file(p / "model.safetensors") for p in (out, whole_run))
    assert all(bool((mine[k] == theirs[k]).all()) for k in theirs)


def test_a_peer_failure_message_is_cut_at_a_word():
    from partita.trainer_failures import _first_words

    text = "Connection closed by peer. This is typically caused by a remote process dying"
    assert _first_words(text, 40) == "Connection closed by peer. This is..."
    assert _first_words("short.\nsecond line", 40) == "short"
