"""Context parallelism against one process with the whole sequence, in float64: losses,
gradient norms, validation loss, every gradient of the first steps and the final
parameters within 1e-10, for cp = 2 and 4, both kinds, with and without grouped-query
attention, and cp combined with data parallelism + ZeRO, with tensor + sequence
parallelism and with a pipeline."""

from __future__ import annotations

from partita.testing import PARITY_MODEL, Case, check_layouts, parity_config

STEPS = 3
MHA = {**PARITY_MODEL, "n_kv_heads": 4}  # the parity model has 2 kv heads for 4 heads
TRAIN = dict(lr=1e-2)
NOISE = ("attn.wk.bias",)  # zero in exact arithmetic (see test_tp_zero.py)


def _case(name: str, model: dict = PARITY_MODEL, zero: bool = False, **parallel) -> Case:
    cfg = parity_config(model=model, parallel=parallel, train=TRAIN)
    return Case(name, cfg, grads_at=() if zero else (0, 1), params=True)


def test_cp2_ring_and_allgather_match_single_process() -> None:
    check_layouts([
        _case("cp2-ring-gqa", cp=2, cp_kind="ring"),
        _case("cp2-ring-mha", MHA, cp=2, cp_kind="ring"),
        _case("cp2-allgather-gqa", cp=2, cp_kind="allgather"),
        _case("cp2-allgather-mha", MHA, cp=2, cp_kind="allgather"),
    ], 2, STEPS, skip_params=NOISE)


def test_cp4_and_cp_with_dp_zero_and_tp_match_single_process() -> None:
    check_layouts([
        _case("cp4-ring-gqa", cp=4, cp_kind="ring"),
        _case("cp4-allgather-mha", MHA, cp=4, cp_kind="allgather"),
        _case("dp2-cp2-zero3-ring", zero=True, dp=2, cp=2, zero_stage=3, bucket_mb=0.02),
        _case("dp2-cp2-zero1-allgather", zero=True, dp=2, cp=2, zero_stage=1,
              cp_kind="allgather"),
        _case("cp2-tp2-sp-ring-gqa", cp=2, tp=2, sequence_parallel=True),
        _case("cp2-tp2-allgather-mha", MHA, cp=2, tp=2, cp_kind="allgather"),
        _case("cp2-pp2-ring-gqa", cp=2, pp=2),
    ], 4, STEPS, skip_params=NOISE)


def test_cp_tp_sp_pp_on_8_processes_matches_single_process() -> None:
    # Every dimension that shards the model or the sequence at once: the ring inside a
    # pipeline stage, on heads split over tp, with the sequence split over tp as well.
    check_layouts([_case("cp2-tp2-sp-pp2-ring-gqa", cp=2, tp=2, pp=2,
                         sequence_parallel=True)], 8, 2, skip_params=NOISE, timeout=400)
