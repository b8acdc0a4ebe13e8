"""The composition's contracts, checked without processes (pure logic)."""

from __future__ import annotations

import inspect

import pytest
import torch

from partita.config import Config
from partita.errors import PartitaError
from partita.loss import cross_entropy
from partita.mesh import Mesh
from partita.models.plan import ModelPlan
from partita.models.transformer import Transformer, transformer_plan
from partita.parallelize import (
    MicrobatchRunner,
    ShardedModel,
    StepRunner,
    wrap_data_parallel,
)
from partita.pipeline.runtime import PipelineRunner


@pytest.mark.parametrize("runner", [MicrobatchRunner, PipelineRunner])
def test_both_runners_are_step_runners(runner):
    assert issubclass(runner, StepRunner)
    for method in ("train", "evaluate"):
        want = list(inspect.signature(getattr(StepRunner, method)).parameters)
        got = list(inspect.signature(getattr(runner, method)).parameters)
        assert got == want, (runner.__name__, method, got)


def test_meta_model_without_init_rule_is_refused():
    """Parallel code draws meta parameters only through the plan's init rule."""
    cfg = Config().model_config()
    with torch.device("meta"):
        model = Transformer(cfg)
    plan = transformer_plan(cfg)
    bare = ModelPlan(roles=plan.roles, shape=cfg)  # no init rule
    mesh = Mesh.__new__(Mesh)  # never reached: the check comes first
    with pytest.raises(PartitaError, match="init rule"):
        wrap_data_parallel(ShardedModel(model, bare, None, cross_entropy, None), mesh,
                           *([None] * 3), torch.device("cpu"))
