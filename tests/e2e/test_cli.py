"""The real command line, end to end: training runs, layouts agree, errors are clean."""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from partita.testing import free_port


def test_help_lists_every_command(cli):
    out = cli("--help").stdout
    for command in ("train", "generate", "bench", "plan", "schedule"):
        assert command in out


LAYOUTS = {"single": ["--nproc", "1"], "dp2": ["--nproc", "2"],
           "tp2-sp": ["--nproc", "2", "--parallel.tp=2", "--parallel.sequence_parallel"]}
# The training runs of this file, by name: the layouts' float64 runs, a run whose loss
# becomes nan, and one that evaluates on steps it does not log.
RUNS = {**{name: [*extra, "--train.dtype=float64"] for name, extra in LAYOUTS.items()},
        "nan": ["--nproc", "2", "--train.lr=1e30", "--train.warmup_steps=0",
                "--train.grad_clip=0"],
        "eval not logged": ["--nproc", "1", "--train.steps=6", "--train.eval_every=3",
                            "--train.log_every=2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache) -> dict:
    """Every training run of this file, three at a time: each is mostly process start-up
    and a few tiny steps, so they overlap; each is checked by its own test."""
    from tests.conftest import CLI

    cli, root = CLI(cache), tmp_path_factory.mktemp("runs")
    with ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(cli.train, root / name, *args)
                   for name, args in RUNS.items()}
        return {name: (future.result(), root / name) for name, future in futures.items()}


def test_layouts_give_the_same_loss_curve_and_generate_reads_the_weights(runs, cli):
    curves = {}
    for name in LAYOUTS:
        result, out = runs[name]
        assert result.returncode == 0, result.stderr[-3000:]
        last = result.stdout.strip().splitlines()[-1]
        assert last.startswith("done: 6 steps, train loss"), last
        # The whole run's rate, and the training steps' own after the first (warm-up).
        assert re.search(r"[\d,]+ tokens/s \([\d,]+ in the training steps after the "
                         r"first\)$", last), last
        curves[name] = cli.losses(out)
        assert not (out / "checkpoints").exists()  # nothing saved: no empty folder left
    for name, curve in curves.items():
        assert curve == pytest.approx(curves["single"], rel=1e-10), name
    assert curves["single"][-1] < curves["single"][0]
    text = cli("generate", "--run", str(runs["dp2"][1]), "--prompt", "def ",
               "--tokens", "20")
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("def ") and len(text.stdout) > 4


def test_two_launchers_form_one_two_node_job(run_dir, cli):
    port = free_port()
    common = cli.train_args(run_dir, "--nproc", "1", "--nnodes", "2",
                            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=twonode")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "partita.cli", *common],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    for node, (_out, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    done = [out for out, _ in outputs if "done:" in out]
    assert len(done) == 1  # global rank 0 lives on one of the two nodes
    assert "dp=2 tp=1 pp=1" in done[0]


@pytest.mark.parametrize("args,message", [
    (["--parallel.tp=3"], "does not divide the world size"),
    (["--parallel.dp=4"], "needs 4 processes but 2 were started"),
    (["--model.n_heads=3"], "not divisible by model.n_heads"),
    (["--train.stepz=3"], "Did you mean 'train.steps'"),
    (["--data.source=/no/such/place"], "does not exist"),
    (["--train.steps=1e400"], "train.steps='1e400' is too large"),
    (["--parallel.tp=0"], "parallel.tp=0 is out of range: use a positive integer"),
    (["--precision.param_dtype=fp16", "--precision.master_weights=false"],
     "keep precision.master_weights=true"),
    (["--train.collective_timeout_s=1e30"], "train.collective_timeout_s=1e+30 is out of range"),
    (["--train.global_batch=100000"], "fewer than one global batch of 100,000"),
])
def test_bad_input_is_one_paragraph_not_a_traceback(args, message, run_dir, cli):
    result = cli.train(run_dir, "--nproc", "2", *args)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()  # refused before launch: nothing of the run written


def test_unreadable_token_file_is_reported(tmp_path, run_dir, cli):
    bad = tmp_path / "tokens.bin"
    bad.write_bytes(b"PTOK" + b"\x00" * 5)
    result = cli.train(run_dir, "--nproc", "1", f"--data.source={bad}")
    assert result.returncode != 0
    assert "partita: error:" in result.stderr and "Traceback" not in result.stderr


def test_nan_loss_stops_naming_the_step_and_writes_no_weights(runs):
    result, out = runs["nan"]
    assert result.returncode != 0
    assert "became nan" in result.stderr and "at step" in result.stderr
    assert not (out / "model.safetensors").exists()
    assert "done:" not in result.stdout
    assert result.stderr.count("partita: error: the") == 1  # said once, not once per rank


def test_a_launched_process_that_crashes_shows_its_traceback(tmp_path):
    """An exception that is not partita's own (a CUDA error, a bug) reaches the user.
    (In a process of its own: the workers write to the launcher's stderr as it was when
    their fork server started, which pytest's capture would have swapped.) A job that
    ends, well or not, leaves nothing in the temporary folder (torch's agent makes a log
    folder per job there). The temporary folder's path is long on purpose: too long
    for the fork server's socket under it (a scheduler's per-job TMPDIR can be)."""
    script = ("import operator\n"
              "from partita.errors import PartitaError\n"
              "from partita.launch import LaunchSpec, launch\n"
              "print('returned:', launch(LaunchSpec(nproc=1), operator.add, 1, 2))\n"
              "try:\n"
              "    launch(LaunchSpec(nproc=1), operator.truediv, 1, 0)\n"
              "except PartitaError as exc:\n"
              "    print('raised:', exc)\n")
    temp = tmp_path / ("long-temporary-folder-" * 3)
    temp.mkdir()
    assert len(str(temp)) + 32 > 107
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "TMPDIR": str(temp)})
    assert "returned: [3]" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "raised: process 0 of the job stopped with exit code 1" in result.stdout, (
        result.stdout + result.stderr[-2000:])
    assert "partita: process 0 failed" in result.stderr
    assert "ZeroDivisionError" in result.stderr
    assert not list(temp.iterdir())


def test_more_processes_than_gpus_is_refused_before_launch(monkeypatch, capsys, cli, run_dir):
    """NCCL takes one process per GPU: asking for more says what to change instead of
    failing inside NCCL's setup ("Duplicate GPU detected") after the launch."""
    import torch

    from partita.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code = main(cli.train_args(run_dir, "--nproc", "2"))
    assert code == 2
    err = capsys.readouterr().err
    assert "2 processes on this node but 1 GPU(s) visible" in err and "--nproc 1" in err


def test_a_validation_loss_is_logged_at_the_step_it_was_measured(runs):
    """eval_every=3 with log_every=2: the step-3 evaluation was reported on the step-4
    line, as if measured on step 4's weights."""
    result, run_dir = runs["eval not logged"]
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r.get("val_loss") for r in records if "step" in r}
    assert val[3] is not None and val[6] is not None, val
    assert val.get(2) is None and val.get(4) is None, val


@pytest.mark.parametrize("seed", ["18446744073709551616", "-1"])
def test_a_sampling_seed_beyond_64_bits_is_refused_by_the_parser(seed, capsys):
    """torch's generator raised an overflow traceback (or wrapped a negative seed)."""
    from partita.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--seed", seed])
    assert "out of range" in capsys.readouterr().err
