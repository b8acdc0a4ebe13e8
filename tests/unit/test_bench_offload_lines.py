"""`partita bench offload`'s lines without DeepSpeed: a skipped peer is said to be
skipped, the verdict line has no nan, the disk line's ratios say which is which, and a
disk share that runs more rounds than --rounds says so. Partita's runners and the disk
probe are replaced by fakes with set rates, so the figures are known (the real run is
tests/e2e/test_bench_cli.py)."""

import argparse
import types

import pytest
import torch

from partita.bench import offload
from partita.cli import parser_for

# Per round: bytes a disk step moves, its seconds, and the probe's bytes/s.
MOVED = 100e6
PIPE_SECONDS = [1.0, 0.2]  # 100 and 500 MB/s
SEQUENTIAL = [1000e6, 100e6]  # ratios 0.1 and 5.0; medians 300 and 550 MB/s


class FakeDisk:
    direct, subgroup, dtype = True, 1_000_000, torch.float32

    def __init__(self):
        self.bytes_read = self.bytes_written = 0
        self.seconds = 0.0
        self.steps = 0


def fake_partita(args, mode, directory, stage=2):
    disk = FakeDisk() if mode == "optimizer+disk" else None

    def step(tokens):
        if disk is not None:
            took = PIPE_SECONDS[disk.steps % 2]
            disk.steps += 1
            disk.bytes_read += MOVED / 2
            disk.bytes_written += MOVED / 2
            disk.seconds += took
        return 0.01
    return types.SimpleNamespace(dp=types.SimpleNamespace(disk=disk)), step


def run(monkeypatch, capsys, tmp_path, *argv):
    probes = iter(SEQUENTIAL * 8)
    monkeypatch.setattr(offload, "_partita", fake_partita)
    monkeypatch.setattr(offload, "sequential_bandwidth", lambda *a, **k: next(probes))
    monkeypatch.setattr(offload, "_deepspeed", lambda *a, **k: pytest.fail("no peer"))
    args = parser_for(["bench", "offload"]).parse_args(
        ["bench", "offload", "--dir", str(tmp_path), *argv])
    assert isinstance(args, argparse.Namespace)
    assert offload.run(args) == 0
    return capsys.readouterr().out.strip().splitlines()


def test_without_a_peer_the_lines_say_it_was_skipped_and_the_verdict_has_no_nan(
        monkeypatch, capsys, tmp_path):
    lines = run(monkeypatch, capsys, tmp_path, "--peer", "none", "--rounds", "2",
                "--steps", "1")
    assert "DeepSpeed ZeRO-Offload: not run, skipped by request (--peer none)" in lines
    assert "DeepSpeed NVMe offload: not run, skipped by request (--peer none)" in lines
    assert not any("could not run" in line for line in lines), lines
    assert lines[-1] == ("offload: worst partita/peer step-time ratio n/a (no peer ran); "
                         "disk offload at 255% of sequential disk bandwidth")


def test_the_disk_line_names_the_median_ratio_and_the_ratio_of_medians(
        monkeypatch, capsys, tmp_path):
    lines = run(monkeypatch, capsys, tmp_path, "--peer", "none", "--rounds", "2",
                "--steps", "1")
    disk = next(line for line in lines if line.startswith("disk offload (O_DIRECT"))
    assert disk.endswith(
        "moved 100.0 MB per step at median 300 MB/s over the step's read-update-write "
        "pipeline; sequential bandwidth here, measured after each step the same way: "
        "median 550 MB/s (ratio of these medians 0.545); median of the per-round "
        "pipeline/sequential ratios 2.550 (0.100-5.000: range of 2 rounds, 50% for the "
        "median)"), disk


def test_a_disk_share_longer_than_rounds_says_why(monkeypatch, capsys, tmp_path):
    lines = run(monkeypatch, capsys, tmp_path, "--peer", "none", "--rounds", "1",
                "--steps", "1")
    disk = next(line for line in lines if line.startswith("disk offload (O_DIRECT"))
    assert disk.endswith("(0.100-5.000: range of 2 rounds, 50% for the median); 2 rounds, "
                         "not --rounds 1: the disk runs at least twice --steps"), disk
