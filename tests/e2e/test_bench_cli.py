"""`partita bench` end to end: a short `bench dp` run prints its table with the
paired rounds' intervals (the statistics are unit-tested in unit/test_bench_paired.py);
a tiny `bench recompute` compares both modes with torch's checkpoint, and a tiny
`bench offload` (without its DeepSpeed peer, which builds for minutes) runs partita's
modes and measures the disk.;
`bench checkpoint --quick` prints the machine, its time and bytes tables and its verdict
line."""

import subprocess
import sys

import pytest


def test_bench_dp_prints_its_table_with_intervals(cli):
    out = cli("bench", "dp", "--world", "2", "--batch", "1", "--seq", "16", "--rounds", "2",
              "--max-rounds", "4", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    row = lines[-2].split()
    assert row[:4] == ["2", "partita", "stage", "0"], lines
    assert int(row[-1]) in (2, 4)  # rounds: 2, or doubled once to the cap
    low, high = (float(x) for x in row[-2].split("-"))
    assert low <= float(row[-3]) <= high
    assert lines[-1].startswith("dp: partita/torch-ddp step-time ratio ")


def test_bench_recompute_compares_both_modes_with_torch(cli):
    out = cli("bench", "recompute", "--dim", "32", "--layers", "1", "--heads", "4", "--seq",
              "32", "--batch", "2", "--rounds", "2", "--max-rounds", "2", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("full ", "selective "))}
    assert set(rows) == {"full", "selective"}, lines
    for row in rows.values():
        assert float(row[-1]) < 1e-5  # partita's gradients equal torch checkpoint's
    none, ours = (float(x.removesuffix("Mi")) for x in rows["full"][1:3])
    assert ours < none  # full recompute holds less than no recompute
    assert lines[-1].startswith("recompute: worst partita/peer step-time ratio ")


def test_bench_offload_runs_partitas_modes_and_measures_the_disk(cli, tmp_path):
    out = cli("bench", "offload", "--peer", "none", "--dim", "32", "--layers", "1", "--seq",
              "16", "--batch", "2", "--steps", "2", "--budget-gb", "0.001", "--dir",
              str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("tokens/s: in memory ") for line in lines), lines
    assert lines[-1].startswith("offload: worst partita/peer step-time ratio n/a (no peer "
                                "ran); disk offload at "), lines


def test_bench_checkpoint_quick_prints_both_tables(cli, tmp_path):
    import re

    out = cli("bench", "checkpoint", "--quick", "--dir", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("machine: ") and "bf16 units " in lines[0], lines[0]
    formula = int(re.search(r"= ([\d,]+) bytes", lines[3]).group(1).replace(",", ""))
    times = [line.split() for line in lines[5:10]]
    assert [(r[0], " ".join(r[1:-5])) for r in times] == [
        ("4", "save"), ("4", "load"), ("2", "save"), ("2", "load"), ("2", "load 4->2")]
    for row in times:
        low, high = (float(x) for x in row[-2].split("-"))
        assert low <= float(row[-3]) <= high
        assert int(row[-1]) == 2
    sizes = [line.split() for line in lines[11:13]]
    assert [r[0] for r in sizes] == ["4", "2"]
    for row in sizes:  # every byte of the state is on disk, for both
        assert int(row[1].replace(",", "")) >= formula
        assert int(row[3].replace(",", "")) >= formula
    assert re.fullmatch(r"checkpoint: worst partita/dcp time ratio \d+\.\d{3}; "
                        r"async stall \d+\.\d% of sync save", lines[-1]), lines[-1]
    assert len(lines) == 14, lines


def test_bench_gpu_names_the_runners_when_profile_names_none(cli):
    """A mistyped --profile runner stops before anything is built (on a GPU the timing
    before the profile takes minutes), listing the runners it can profile."""
    out = cli("bench", "gpu", "--compile", "--profile", "stage 0", timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr[-2000:]
    assert "'partita stage 0 model'" in out.stderr and "'stage 0'" in out.stderr
    assert "partita: error: bench gpu: --profile" in out.stderr  # a refusal, said as one


def test_bench_gpu_without_a_gpu_is_refused_as_any_error(cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    out = cli("bench", "gpu", "--rounds", "1", timeout=120)
    assert out.returncode == 2 and "partita: error: bench gpu: no CUDA device" in out.stderr



def test_every_benchmarks_arguments_can_go_to_its_workers():
    """Several benchmarks send their parsed arguments to their worker processes; a
    closure among them (the function that names the machine) made `bench tp`, `pp`
    and `pp-bubble` fail at start with a pickling traceback."""
    import pickle

    from partita.cli import parser_for
    from partita.commands.bench import BENCHMARKS

    for name in BENCHMARKS:
        args = parser_for(["bench", name]).parse_args(["bench", name])
        pickle.dumps(args)


def test_help_lists_every_benchmark_without_importing_one():
    """`partita --help` and `partita bench --help` read the benchmarks' summaries from
    their sources: importing one imports torch, seconds before any help shows."""
    import importlib

    program = ("import sys\nfrom partita.cli import main\ntry:\n    main(sys.argv[1:])\n"
               "finally:\n    print('torch imported' if 'torch' in sys.modules "
               "else 'no torch')")
    listed = subprocess.run([sys.executable, "-c", program, "bench", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.rstrip().endswith("no torch")
    from partita.commands.bench import BENCHMARKS

    for name, path in BENCHMARKS.items():
        first = importlib.import_module(path).__doc__.strip().splitlines()[0]
        assert f"    {name}" in listed.stdout and first[:30] in listed.stdout, name
    top = subprocess.run([sys.executable, "-c", program, "--help"], capture_output=True,
                         text=True, timeout=60)
    assert top.returncode == 0 and top.stdout.rstrip().endswith("no torch"), top.stderr
