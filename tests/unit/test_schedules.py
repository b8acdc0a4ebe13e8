"""Pipeline schedules as data: generation, validation, simulation, printing, splitting."""

from __future__ import annotations

import itertools

import pytest

from partita.cli import main
from partita.errors import PartitaError
from partita.pipeline import (
    Action,
    Costs,
    Kind,
    ScheduleError,
    build_schedule,
    draw_timeline,
    find_problems,
    format_grid,
    in_flight_peaks,
    parse_actions,
    rank_in_flight_peak,
    simulate,
    split_blocks,
    validate,
)

NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def bubble(name: str, p: int, m: int, v: int = 1, costs: Costs | None = None) -> float:
    return simulate(build_schedule(name, p, m, v), costs).bubble_fraction


# --- every schedule is valid ------------------------------------------------------


def test_every_schedule_validates():
    valid = 0
    for name, p, m, v in itertools.product(NAMES, (1, 2, 4), range(1, 9), (1, 2)):
        try:
            sched = build_schedule(name, p, m, v)
        except PartitaError:
            # Only the documented preconditions may refuse: v > 1 outside interleaved,
            # and interleaved with m not a multiple of p or one stage per rank.
            interleaved = name == "interleaved-1f1b"
            assert ((v > 1 and not interleaved) or m % p != 0
                    or (interleaved and v == 1 and p > 1))
            continue
        validate(sched)
        assert sched.n_stages == p * v and len(sched.ranks) == p
        valid += 1
    assert valid >= 90  # the loop really checked schedules, not only refusals


@pytest.mark.parametrize("name", NAMES)
def test_each_pass_runs_once_on_its_rank(name):
    sched = build_schedule(name, 4, 8, 2 if name == "interleaved-1f1b" else 1)
    forwards = [a for acts in sched.ranks for a in acts if a.kind is Kind.F]
    assert len(forwards) == len(set(forwards)) == sched.n_stages * 8
    for r, acts in enumerate(sched.ranks):
        assert {a.local_stage for a in acts} <= set(sched.stages_of(r))


def test_stage_to_rank_is_round_robin():
    sched = build_schedule("interleaved", 4, 8, 2)
    assert [sched.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert sched.stages_of(1) == (1, 5)
    assert sched.chunk_of(5) == 1


def test_single_rank_needs_no_transfers():
    sched = build_schedule("interleaved", 1, 3, 2)
    assert all(a.kind.is_compute for a in sched.ranks[0])
    validate(sched)


# --- bubbles and memory against theory --------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (8, 3), (8, 16)])
@pytest.mark.parametrize("backward_cost", [1.0, 2.0, 3.0])
def test_gpipe_and_1f1b_bubble_formula(name, p, m, backward_cost):
    # Every rank but 0 runs its last backward as I then W (its input gradient leaves
    # before W). Priced as a whole backward (I = B, W = 0), the bubble is the classic
    # (p-1)/(m+p-1); with W = I = B/2 it is never larger, and 1F1B's step (GPipe's
    # with one microbatch) is shorter by at least min(W, F). With equal stages that is
    # about all (the ranks run in lockstep, so most hops find the rank before still
    # busy); when the last stage (head, loss) is slower the ranks before it wait at
    # every hop and each saves a W. `partita bench pp` measures the real case.
    F, B = 1.0, backward_cost
    whole = bubble(name, p, m, costs=Costs(F=F, B=B, I=B, W=0.0))
    assert whole == pytest.approx((p - 1) / (m + p - 1))
    split = simulate(build_schedule(name, p, m), Costs(F=F, B=B, I=B / 2, W=B / 2))
    classic = (m + p - 1) * (F + B)
    assert split.makespan <= classic
    if name == "1f1b" or m == 1:
        assert split.makespan <= classic - min(B / 2, F)


@pytest.mark.parametrize(
    "p,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 4), (2, 6, 3)]
)
def test_interleaved_bubble_is_about_one_over_v(p, m, v):
    got = bubble("interleaved", p, m, v)
    assert got == pytest.approx((p - 1) / (v * m + p - 1))
    assert got < bubble("1f1b", p, m)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 16, 2), (8, 16, 2)])
def test_interleaved_warmup_hides_transfer_latency(p, m, v):
    # Megatron's longer warm-up gives slack, so transfer time costs less than in 1F1B.
    slow = Costs(comm=0.3)
    lost_interleaved = bubble("interleaved", p, m, v, slow) - bubble("interleaved", p, m, v)
    lost_1f1b = bubble("1f1b", p, m, costs=slow) - bubble("1f1b", p, m)
    assert 0 < lost_interleaved < lost_1f1b


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_zb_h1_bubble(p, m):
    # With F = I = W = 1 the ZB-H1 bubble is (p-1) units per rank, a third of the
    # classic 1F1B bubble (a whole B per hop); our 1F1B splits only its last backward.
    costs = Costs(F=1, B=2, I=1, W=1)
    zb = bubble("zb-h1", p, m, costs=costs)
    ofob = bubble("1f1b", p, m, costs=costs)
    assert zb == pytest.approx((p - 1) / (3 * m + p - 1))
    assert zb < ofob
    if m >= 4 * p:
        assert zb < 0.4 * (p - 1) / (m + p - 1)  # about a third


@pytest.mark.parametrize("p,m", [(1, 3), (2, 5), (4, 8), (4, 3)])
def test_peak_in_flight_activations(p, m):
    gpipe = build_schedule("gpipe", p, m)
    assert set(in_flight_peaks(gpipe).values()) == {m}
    ofob = build_schedule("1f1b", p, m)
    assert [rank_in_flight_peak(ofob, r) for r in range(p)] == [min(p - r, m) for r in range(p)]
    assert in_flight_peaks(ofob)[0] <= p
    # ZB-H1 defers W on later ranks but never beyond 1F1B's peak (that of rank 0).
    zb = build_schedule("zb-h1", p, m)
    assert max(rank_in_flight_peak(zb, r) for r in range(p)) == min(p, m)


def test_transfer_cost_lengthens_the_step():
    sched = build_schedule("1f1b", 4, 8)
    assert simulate(sched, Costs(comm=0.5)).makespan > simulate(sched).makespan


# --- the validator catches broken schedules ----------------------------------------


def _without(actions, text):
    drop = Action.parse(text)
    assert drop in actions
    return [a for a in actions if a != drop]


def test_missing_receive_is_reported():
    sched = build_schedule("1f1b", 2, 2)
    broken = sched.replace_rank(1, _without(sched.ranks[1], "RF0.1"))
    problems = find_problems(broken)
    assert any("RF0.1 is missing" in p for p in problems), problems
    with pytest.raises(ScheduleError, match="RF0.1"):
        validate(broken)


def test_missing_send_is_reported():
    sched = build_schedule("gpipe", 2, 2)
    broken = sched.replace_rank(1, _without(sched.ranks[1], "SB1.0"))
    assert any("SB1.0 is missing" in p for p in find_problems(broken))


def test_duplicate_forward_is_reported():
    sched = build_schedule("1f1b", 2, 3)
    acts = list(sched.ranks[0])
    acts.insert(1, Action(Kind.F, 0, 0))
    problems = find_problems(sched.replace_rank(0, acts))
    assert any("F0.0 appears 2 times" in p for p in problems), problems


def test_backward_before_forward_is_reported():
    sched = build_schedule("1f1b", 2, 2)
    last = list(sched.ranks[1])
    i, j = last.index(Action.parse("F1.0")), last.index(Action.parse("B1.0"))
    last[i], last[j] = last[j], last[i]
    with pytest.raises(ScheduleError, match=r"rank 1, action #\d+ B1.0: needs F1.0"):
        validate(sched.replace_rank(1, last))


@pytest.mark.parametrize(
    "name,rank,first,second,needed",
    [
        ("gpipe", 1, "RF0.0", "F1.0", "RF0.0"),  # forward before its input arrived
        ("zb-h1", 0, "I0.0", "W0.0", "I0.0"),  # weight gradient before input gradient
        ("gpipe", 0, "F0.0", "SF0.0", "F0.0"),  # sending what is not computed yet
        ("1f1b", 0, "RB1.0", "B0.0", "RB1.0"),  # backward before its gradient arrived
    ],
)
def test_pass_before_its_input_is_reported(name, rank, first, second, needed):
    sched = build_schedule(name, 2, 2)
    acts = list(sched.ranks[rank])
    i, j = acts.index(Action.parse(first)), acts.index(Action.parse(second))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match=f"{second}: needs {needed}"):
        validate(sched.replace_rank(rank, acts))


def test_deadlock_is_reported_with_stuck_ranks():
    # Rank 0 waits for the gradient of microbatch 0 before sending its activation.
    sched = build_schedule("1f1b", 2, 2)
    rank0 = parse_actions("F0.0 RB1.0 SF0.0 F0.1 SF0.1 B0.0 RB1.1 B0.1")
    assert sorted(map(str, rank0)) == sorted(map(str, sched.ranks[0]))
    with pytest.raises(ScheduleError, match="deadlocks") as err:
        validate(sched.replace_rank(0, rank0))
    assert "rank 0 waits at action #1 RB1.0" in str(err.value)
    assert "rank 1 waits at action #0 RF0.0" in str(err.value)


def test_action_on_wrong_rank_is_reported():
    sched = build_schedule("gpipe", 2, 1)
    moved = sched.replace_rank(0, list(sched.ranks[0]) + [Action(Kind.W, 1, 0)])
    assert any("stage 1 lives on rank 1" in p for p in find_problems(moved))


def test_mixed_full_and_split_backward_is_reported():
    sched = build_schedule("gpipe", 1, 1)
    broken = sched.replace_rank(0, parse_actions("F0.0 B0.0 W0.0"))
    assert any("B x1, I x0, W x1" in p for p in find_problems(broken))


# --- actions and preconditions ----------------------------------------------------


def test_compact_form_round_trips():
    for text in ("F3.1", "B0.0", "I2.7", "W2.7", "SF3.1", "RF3.1", "SB2.0", "RB12.5"):
        assert str(Action.parse(text)) == text
    assert Action.parse("SB2.0") == Action(Kind.SEND_B, 2, 0)
    assert Action.parse("RF3.1").local_stage == 4
    assert Action.parse("SB2.0").peer_stage == 1
    with pytest.raises(PartitaError, match="not a pipeline action"):
        Action.parse("X1.0")


def test_interleaved_needs_multiple_of_stages():
    with pytest.raises(PartitaError, match="multiple of 4; got 6. Use 4 or 8"):
        build_schedule("interleaved-1f1b", 4, 6, 2)
    with pytest.raises(PartitaError, match="multiple of 4; got 2. Use 4 microbatches"):
        build_schedule("interleaved", 4, 2, 2)


def test_unknown_name_suggests_the_closest():
    with pytest.raises(PartitaError, match="Did you mean '1f1b'"):
        build_schedule("1fb1", 2, 4)
    with pytest.raises(PartitaError, match="Known schedules"):
        build_schedule("nonsense", 2, 4)


def test_interleaved_defaults_to_two_virtual_stages(capsys):
    assert build_schedule("interleaved", 2, 4).n_virtual == 2
    assert build_schedule("1f1b", 2, 4).n_virtual == 1
    assert main(["schedule", "interleaved", "-p", "2", "-m", "2"]) == 0
    assert "2 stage(s) per rank" in capsys.readouterr().out


def test_virtual_stages_only_for_interleaved():
    with pytest.raises(PartitaError, match="use interleaved-1f1b"):
        build_schedule("zero-bubble", 2, 4, 2)


@pytest.mark.parametrize("p,m,v", [(0, 4, 1), (2, 0, 1), (2, 4, 0)])
def test_sizes_must_be_positive(p, m, v):
    with pytest.raises(PartitaError, match="at least 1"):
        build_schedule("1f1b", p, m, v)


# --- printing and drawing ----------------------------------------------------------


def test_grid_shows_idle_and_passes():
    grid = format_grid(simulate(build_schedule("gpipe", 2, 2)))
    rows = grid.splitlines()
    # Rank 0 waits three units for the first gradient: 2 of rank 1's B0 after its F1.
    # Rank 1's last backward runs as I then W (its gradient leaves before W).
    assert rows[1].split()[2:] == ["F0", "F1", ".", ".", ".", "B0", "B0", "B1", "B1"]
    assert rows[2].split()[2:] == [".", "F0", "F1", "B0", "B0", "I1", "W1", ".", "."]


def test_grid_names_chunks_when_interleaved():
    grid = format_grid(simulate(build_schedule("interleaved", 2, 2, 2)))
    assert "F0a" in grid and "F0b" in grid and "B1a" in grid


def test_cli_prints_grid(capsys):
    assert main(["schedule", "1f1b", "--stages", "2", "--microbatches", "3"]) == 0
    out = capsys.readouterr().out
    assert "bubble 18.2%" in out  # 11 units; 12 (25%) if rank 1's last B were whole
    assert "rank  1" in out and "F2" in out and "B2" in out


def test_cli_lists_actions(capsys):
    assert main(["schedule", "zb-h1", "-p", "2", "-m", "2", "--actions"]) == 0
    assert "rank 0: F0.0 SF0.0 F0.1 SF0.1 RB1.0 I0.0 W0.0" in capsys.readouterr().out


def test_cli_reports_bad_input(capsys):
    assert main(["schedule", "gpip", "--stages", "2", "--microbatches", "3"]) == 2
    assert "Did you mean 'gpipe'" in capsys.readouterr().err
    assert main(["schedule", "interleaved", "-p", "4", "-m", "6", "-v", "2"]) == 2
    assert "multiple of 4" in capsys.readouterr().err


def test_cli_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sched.png"
    args = ["schedule", "interleaved", "-p", "2", "-m", "4", "-v", "2", "--png", str(out)]
    assert main(args) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draw_measured_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        [(Action.parse("F0.0"), 0.0, 0.01), (Action.parse("SF0.0"), 0.01, 0.012)],
        [(Action.parse("RF0.0"), 0.0, 0.012), (Action.parse("F1.0"), 0.012, 0.02)],
    ]
    path = draw_timeline(rows, tmp_path / "run.png", title="measured", time_unit="s")
    assert path.stat().st_size > 1000


# --- splitting blocks between stages ------------------------------------------------


def test_even_split():
    assert split_blocks(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_blocks(4, 4) == [range(i, i + 1) for i in range(4)]


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(PartitaError, match="cannot split 3 transformer blocks into 4"):
        split_blocks(3, 4)
    with pytest.raises(PartitaError, match="one each"):
        split_blocks(4, 2, costs=[1.0, 1.0])


def test_embedding_and_head_shift_blocks_inward():
    split = split_blocks(8, 4, first_extra=2.0, last_extra=2.0)
    assert [len(r) for r in split] == [1, 3, 3, 1]


def _best_max_cost(costs, n_stages, first, last):
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), n_stages - 1):
        bounds = (0, *cuts, len(costs))
        loads = [sum(costs[bounds[i] : bounds[i + 1]]) for i in range(n_stages)]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_split_is_optimal(seed):
    import random

    rng = random.Random(seed)
    n = rng.randint(2, 9)
    stages = rng.randint(1, n)
    costs = [rng.choice([0.5, 1.0, 2.0, 3.0, 5.0]) for _ in range(n)]
    first, last = rng.choice([0.0, 1.0, 4.0]), rng.choice([0.0, 2.0, 6.0])
    split = split_blocks(n, stages, costs, first, last)
    assert [b for r in split for b in r] == list(range(n)) and all(len(r) for r in split)
    loads = [sum(costs[b] for b in r) for r in split]
    loads[0] += first
    loads[-1] += last
    assert max(loads) == pytest.approx(_best_max_cost(costs, stages, first, last))


def test_interleaving_one_virtual_stage_is_refused():
    # It drew (and trained) plain 1F1B under the interleaved name.
    with pytest.raises(PartitaError, match="nothing to interleave"):
        build_schedule("interleaved-1f1b", 2, 4, 1)
    assert build_schedule("interleaved-1f1b", 2, 4).n_virtual == 2
