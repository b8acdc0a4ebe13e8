"""What the benchmark tables call their intervals: a column headed "interval", and a
legend under it only where some row's interval is not a 99% one (fewer than 8 rounds:
the range of the rounds, `partita.bench.paired`), so that a short run such as
`--rounds 2 --max-rounds 2` prints no "99% interval" for a range of 2 rounds."""

from partita.bench import checkpoint, cp, dp, ep, gpu, pp, recompute, tp
from partita.bench.paired import FULL_ROUNDS, estimate, legend


def ratios(n: int) -> list[float]:
    return [0.9 + 0.01 * i for i in range(n)]


def test_the_legend_names_only_the_intervals_short_of_99_percent():
    two, eight = estimate(ratios(2)), estimate(ratios(8))
    assert FULL_ROUNDS == 8
    assert legend([eight, estimate(ratios(24))]) is None
    assert legend([]) is None
    line = legend([eight, two])
    assert line == ("interval: 99% for the median from 8 rounds on; below that: "
                    "range of 2 rounds, 50% for the median")
    assert "99% interval" not in line
    # One entry per number of rounds, fewest first.
    assert legend([estimate(ratios(6)), two, estimate([1.0]), estimate(ratios(2))]) == (
        "interval: 99% for the median from 8 rounds on; below that: 1 round, no "
        "interval; range of 2 rounds, 50% for the median; range of 6 rounds, 97% for "
        "the median")


def test_a_verdict_says_99_percent_only_of_a_99_percent_interval():
    eight = estimate(ratios(8))
    assert eight.stated == f"99% interval {eight.span}, 8 rounds"
    two = estimate(ratios(2))
    assert two.stated == f"{two.span}: range of 2 rounds, 50% for the median"
    assert estimate([1.0]).stated == "1 round, no interval"


def test_no_table_heads_its_column_99_percent():
    heads = [dp.TABLE_HEAD, checkpoint.TABLE_HEAD, checkpoint.BYTES_HEAD, gpu.HEAD]
    for head in heads:
        assert "99%" not in head and " interval " in head, head
    # The other tables' heads are printed inside `run`; their source says it.
    for module in (cp, ep, pp, recompute, tp):
        source = open(module.__file__).read()
        assert "{'99% interval'" not in source, module.__name__
        assert "{'interval'" in source, module.__name__


def dp_row(n: int) -> dict:
    return {"ours": "partita stage 0", "peer": "torch DDP", "t_ours": [0.1] * n,
            "t_peer": [0.1] * n, "estimate": estimate(ratios(n))}


def test_bench_dp_table_of_2_rounds_says_what_its_interval_is(capsys):
    dp.print_table([dp_row(2)], 2)
    lines = capsys.readouterr().out.strip().splitlines()
    assert "99% interval" not in "\n".join(lines)
    assert lines[0] == legend([estimate(ratios(2))])
    assert lines[1] == dp.TABLE_HEAD
    row = lines[-1].split()  # the row stays last, right above the verdict line
    assert row[:4] == ["2", "partita", "stage", "0"] and row[-1] == "2"
    assert row[-2] == estimate(ratios(2)).span


def test_bench_dp_table_of_8_rounds_has_no_legend(capsys):
    dp.print_table([dp_row(8)], 2)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == dp.TABLE_HEAD and len(lines) == 2


def checkpoint_results(n: int) -> list[dict]:
    """A --quick run's results, as `_worker` returns them: worlds 4 and 2, the second
    also loading the first's checkpoint."""
    est = estimate(ratios(n))
    return [{"world": world,
             "rows": [{"what": what, "partita": 1.0, "dcp": 1.1, "estimate": est}
                      for what in whats],
             "bytes": {"partita": 1200, "dcp": 1300},
             "async": {"stall": 0.1, "total": 1.0, "ratio": estimate([0.1] * n)}}
            for world, whats in ((4, ("save", "load")), (2, ("save", "load", "load 4->2")))]


def test_bench_checkpoint_quick_report_says_what_its_intervals_are(capsys):
    checkpoint.print_report(checkpoint.QUICK, 100, checkpoint_results(2))
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 13  # the machine's line comes before: 14 in all, as ever
    assert lines[1].endswith("; " + legend([estimate(ratios(2))])), lines[1]
    assert lines[3] == checkpoint.TABLE_HEAD and lines[9] == checkpoint.BYTES_HEAD
    for line in lines[3:]:
        assert "99%" not in line, line


def test_bench_checkpoint_report_of_8_rounds_has_no_legend(capsys):
    checkpoint.print_report(checkpoint.Setup(), 100, checkpoint_results(8))
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 13
    assert lines[1].endswith("page cache warm: every file read once just before each load")
