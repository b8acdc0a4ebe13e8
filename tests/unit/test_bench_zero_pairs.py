"""`partita bench zero --stages`: which pairs a run times."""

from partita.bench.zero import (
    KEEP_ALL_VS_STAGE2,
    PER_BLOCK_VS_STAGE2,
    SELF_PAIR,
    STAGE3_VS_STAGE2,
    pairs,
)


def test_every_stage_by_default_and_deepspeed_only_when_asked():
    assert len(pairs(False)) == 8 and len(pairs(True)) == 11
    assert not any(peer.startswith("DeepSpeed") for _, peer in pairs(False))


def test_stages_choose_the_rows_of_our_side():
    assert pairs(False, (2,)) == [("partita stage 2", "FSDP2 reshard False")]
    three = pairs(True, (3,))
    assert [STAGE3_VS_STAGE2, PER_BLOCK_VS_STAGE2, KEEP_ALL_VS_STAGE2] == three[1:4]
    assert {ours for ours, _ in three} == {"partita stage 3", "stage 3 per block",
                                           "stage 3 keep all"}
    assert SELF_PAIR in pairs(False, (0,)) and SELF_PAIR not in pairs(False, (1, 2, 3))


def test_peers_choose_the_rows_of_the_other_side():
    assert pairs(True, peers=("deepspeed",)) == [
        ("partita stage 1", "DeepSpeed ZeRO 1"), ("partita stage 2", "DeepSpeed ZeRO 2"),
        ("partita stage 3", "DeepSpeed ZeRO 3")]
    assert pairs(False, (0, 1), ("torch",)) == [("partita stage 0", "torch DDP"),
                                                 ("partita stage 1", "torch ZeroRedundancyOpt")]
    assert pairs(True, peers=("partita",)) == [
        STAGE3_VS_STAGE2, PER_BLOCK_VS_STAGE2, KEEP_ALL_VS_STAGE2, SELF_PAIR]
    assert pairs(False, peers=("deepspeed",)) == []


def test_a_choice_without_rows_is_refused_before_anything_starts(capsys):
    from partita.cli import main

    assert main(["bench", "zero", "--stages", "0", "--peers", "deepspeed"]) == 2
    out, err = capsys.readouterr()
    assert ("partita: error: no pair to time: --stages 0 has no rows against --peers "
            "deepspeed") in err
    assert "zero:" not in out  # no header: nothing was started
