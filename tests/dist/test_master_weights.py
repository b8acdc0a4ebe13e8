"""After mixed-precision training the weights a run writes are the fp32 master copy.

Reference: `partita checkpoint export` of a checkpoint of the same state, which takes
each parameter from the optimizer's master where one was kept. The module's own bf16
parameters round that master to 8 significant bits; writing them instead loses what
the master holds beyond (and a run's weights then differ from its checkpoint's export).
"""

from __future__ import annotations

import dataclasses

import torch

from partita.checkpoint.export import full_tensors
from partita.checkpoint.manifest import step_dir_name
from partita.testing import Case, parity_config, run_layouts

STEPS = 3


# Experts are reduced and sharded over their own group (ep=2: each rank's experts alone).
MOE = dict(n_experts=4, top_k=2, expert_ffn_dim=16)


def _case(name: str, tmp, model: dict | None = None, **parallel) -> Case:
    cfg = parity_config(model=model or {}, parallel=dict(bucket_mb=0.02, **parallel),
                        precision=dict(param_dtype="bfloat16"),
                        train=dict(lr=1e-2, dtype="float32"))
    return Case(name, cfg, tol=0.0, save_to=str(tmp / name), weights=True)


def test_the_weights_written_after_bf16_training_are_the_fp32_master(tmp_path) -> None:
    cases = [_case("zero1", tmp_path, zero_stage=1),
             _case("zero3", tmp_path, zero_stage=3),
             _case("zero0-tp2", tmp_path, tp=2),
             _case("zero2-host-offload", tmp_path, zero_stage=2, offload="optimizer"),
             _case("zero3-disk-offload", tmp_path, zero_stage=3, offload="optimizer+disk",
                   offload_dir=str(tmp_path / "swap")),
             _case("zero1-pp2", tmp_path, zero_stage=1, pp=2),
             _case("zero3-moe", tmp_path, MOE, zero_stage=3),
             _case("zero1-ep2", tmp_path, MOE, zero_stage=1, ep=2)]
    for case, ranks in zip(cases, run_layouts(cases, 2, STEPS)):
        written = ranks[0]["weights"]
        assert all(r["weights"] is None for r in ranks[1:]), case.id  # rank 0 writes
        exported = dict(full_tensors(tmp_path / case.id / step_dir_name(STEPS)))
        assert written.keys() == exported.keys(), case.id
        more_precise = 0
        for name, value in written.items():
            assert value.dtype == torch.float32, (case.id, name)
            assert torch.equal(value, exported[name]), (case.id, name)
            more_precise += int(not torch.equal(value, value.bfloat16().float()))
        # Trained values that bf16 cannot hold: the master, not its rounded copy.
        assert more_precise >= len(written) // 2, case.id


def test_the_master_starts_from_the_drawn_values_not_their_bf16_rounding(tmp_path) -> None:
    """Values drawn in float32 (partita's init, or a float32 Hugging Face release read
    by `model.init_from`) were cast to the bf16 parameters first and the master copied
    from those: a float32 checkpoint fine-tuned in bf16 lost its precision before the
    first step. Before any step the master (what the run would write) is the float32
    single-device initialisation itself."""
    from partita.models import build_model

    cases = [_case("zero0", tmp_path), _case("zero1", tmp_path, zero_stage=1),
             _case("zero3", tmp_path, zero_stage=3),
             _case("zero2-host-offload", tmp_path, zero_stage=2, offload="optimizer"),
             _case("zero3-params-disk", tmp_path, zero_stage=3, offload="optimizer+params+disk",
                   offload_dir=str(tmp_path / "swap")),
             _case("zero1-tp2", tmp_path, zero_stage=1, tp=2)]
    cases = [dataclasses.replace(c, save_to="") for c in cases]
    model_cfg = cases[0].cfg.model_config()
    drawn = dict(build_model(model_cfg, dtype=torch.float32).named_parameters())
    for case, ranks in zip(cases, run_layouts(cases, 2, 0)):
        written = ranks[0]["weights"]
        assert written.keys() == drawn.keys(), case.id
        for name, value in written.items():
            assert torch.equal(value, drawn[name].detach()), (case.id, name)
