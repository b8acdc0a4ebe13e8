"""Fine-tuning part of a model (LoRA-style: some weights frozen) under tensor
parallelism: the frozen weights stay frozen, and every layout matches one process.

The model arrives with its values (frozen parameters are not drawn from the plan's
init rule), in float64; attention, the token embedding and the final norm are frozen.
One process and each layout must agree within 1e-10 on the loss, the gradient norm
and every final parameter, and the frozen ones must still hold their initial values.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from partita.models.plan import ModelPlan
from partita.models.transformer import build_model
from partita.parallelize import ParallelModel
from partita.sharding import shard_info
from partita.testing import Case, check_layouts, parity_config

STEPS = 3
MODEL = dict(flavour="gpt2", n_kv_heads=None, seed=3)  # biases on every linear


def frozen(name: str) -> bool:
    return ".attn." in name or name.startswith("tok_embeddings") or name == "norm.weight"


def partly_frozen_model() -> tuple[nn.Module, ModelPlan]:
    """The parity model with its values, attention, embedding and final norm frozen."""
    model = build_model(parity_config(model=MODEL).model_config(), dtype=torch.float64)
    for name, p in model.named_parameters():
        p.requires_grad_(not frozen(name))
    return model, model.plan()


def trainable(pm: ParallelModel, cfg) -> list[str]:
    return sorted(shard_info(p, n).name for n, p in pm.module.named_parameters()
                  if p.requires_grad)


def test_frozen_weights_stay_frozen_and_match_one_process() -> None:
    cases = [Case(f"tp2{'-sp' if sp else ''}-frozen",
                  parity_config(model=MODEL, train=dict(lr=1e-2),
                                parallel=dict(tp=2, sequence_parallel=sp)),
                  params=True, model=partly_frozen_model)
             for sp in (False, True)]
    results = check_layouts(cases, world=2, steps=STEPS, probe=trainable)
    start = dict(partly_frozen_model()[0].named_parameters())
    expected = sorted(n for n in start if not frozen(n))
    for ranks, ref in results:
        for got in ranks:
            assert got["probe"] == expected
        for name, (_, value) in ref["params"].items():
            moved = not torch.equal(value, start[name].detach())
            assert moved != frozen(name), name
