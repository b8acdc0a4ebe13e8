"""`partita bench` end to end: a short `bench dp` run prints its table with the
paired rounds' intervals (the statistics are unit-tested in unit/test_bench_paired.py)."""


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
