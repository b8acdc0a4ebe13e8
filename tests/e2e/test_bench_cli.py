"""`partita bench` end to end: a short `bench dp` run prints its table with the
paired rounds' intervals (the statistics are unit-tested in unit/test_bench_paired.py);
`bench checkpoint --quick` prints its time and bytes tables and its verdict line."""


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


def test_bench_checkpoint_quick_prints_both_tables(cli, tmp_path):
    import re

    out = cli("bench", "checkpoint", "--quick", "--dir", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    formula = int(re.search(r"= ([\d,]+) bytes", lines[2]).group(1).replace(",", ""))
    times = [line.split() for line in lines[4:9]]
    assert [(r[0], " ".join(r[1:-5])) for r in times] == [
        ("4", "save"), ("4", "load"), ("2", "save"), ("2", "load"), ("2", "load 4->2")]
    for row in times:
        low, high = (float(x) for x in row[-2].split("-"))
        assert low <= float(row[-3]) <= high
        assert int(row[-1]) == 2
    sizes = [line.split() for line in lines[10:12]]
    assert [r[0] for r in sizes] == ["4", "2"]
    for row in sizes:  # every byte of the state is on disk, for both
        assert int(row[1].replace(",", "")) >= formula
        assert int(row[3].replace(",", "")) >= formula
    assert re.fullmatch(r"checkpoint: worst partita/dcp time ratio \d+\.\d{3}; "
                        r"async stall \d+\.\d% of sync save", lines[-1]), lines[-1]
    assert len(lines) == 13, lines
