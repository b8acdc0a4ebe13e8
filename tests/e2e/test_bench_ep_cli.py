"""`partita bench ep` end to end: a tiny run against DeepSpeed's MoE layer at world 2
prints its row and the ratio line with its 99% interval (the interval statistics are
unit-tested in unit/test_bench_paired.py; the measured figures are in
docs/expert_parallel.md). DeepSpeed is a benchmark peer, not a test dependency: without
it the command says so and exits 2."""

import importlib.util

import pytest


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="the peer, deepspeed, is not installed")
def test_bench_ep_prints_the_ratio_with_its_interval(cli):
    out = cli("bench", "ep", "--worlds", "2", "--dim", "32", "--ffn", "32", "--batch", "1",
              "--seq", "16", "--rounds", "2", "--max-rounds", "2", "--steps", "1",
              timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    row = next(line.split() for line in lines if line.split()[:1] == ["2"])
    ours, peer, ratio, span, rounds = row[1:6]
    assert int(rounds) == 2
    low, high = (float(v) for v in span.split("-"))
    assert low <= float(ratio) <= high
    assert float(ratio) > 0 and float(ours) > 0 and float(peer) > 0
    assert all(float(v) > 0 for v in row[6:8])  # CPU ms per step, both sides
    last = lines[-1]
    assert last.startswith("ep: worst partita/peer step-time ratio "), last
    assert f"({span}: range of 2 rounds, 50% for the median, at world 2)" in last, last


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None,
                    reason="deepspeed is installed")
def test_bench_ep_without_deepspeed_says_what_to_install(cli):
    out = cli("bench", "ep", "--worlds", "2", timeout=120)
    assert out.returncode == 2
    assert "pip install deepspeed" in out.stderr
