"""`parallelize` driven from a user's script, in one process: what it refuses up front
(blocks that are no ModuleDict, a microbatch count that does not divide the rows, plan
patterns that match nothing) and what it accepts (a device given by name)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partita.errors import PartitaError
from partita.layout import Layout
from partita.mesh import Mesh
from partita.models import plan as roles
from partita.models.hf_llama import llama_model
from partita.models.model_config import ModelConfig
from partita.models.param_init import InitRule, ParamInit
from partita.models.transformer import build_model
from partita.parallelize import build_parallel_model, parallelize
from partita.tensor_parallel.plan_check import check_patterns_match
from partita.testing import PARITY_MODEL, parity_config

SHAPE = ModelConfig(**PARITY_MODEL)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ListLM(nn.Module):
    """A researcher's model: its blocks in an nn.ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(SHAPE.vocab_size, SHAPE.dim)
        self.layers = nn.ModuleList([Block(SHAPE.dim) for _ in range(SHAPE.n_layers)])
        self.out = nn.Linear(SHAPE.dim, SHAPE.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.layers:
            h = block(h)
        return self.out(h)


def _plan(**changes) -> roles.ModelPlan:
    table = {"layers.*.up": roles.COLWISE, "layers.*.down": roles.ROWWISE,
             "layers.*.norm": roles.NORM, "emb": roles.VOCAB_EMBEDDING,
             "out": roles.VOCAB_HEAD}
    plan = roles.ModelPlan(roles=table, blocks="layers", embedding="emb", head=("out",),
                           init=ParamInit(lambda name: InitRule("normal", 0.02), 0),
                           shape=SHAPE)
    return dataclasses.replace(plan, **changes)


def _one_rank() -> Mesh:
    return Mesh(Layout(), 0, 1)


def test_a_device_given_by_name_is_taken():
    pm = build_parallel_model(parity_config(), _one_rank(), "cpu")
    assert pm.device == torch.device("cpu")
    with torch.device("meta"):
        model = ListLM()
    model.layers = nn.ModuleDict({str(i): b for i, b in enumerate(model.layers)})
    pm = parallelize(model, _plan(), parity_config(), _one_rank(), "cpu")
    assert pm.device == torch.device("cpu")


def test_microbatches_that_do_not_divide_the_rows_are_refused():
    """4 rows in 3 microbatches trained 2/3 of the loss and gradient; 5 rows in 4
    weighted unequal chunks as equals. A count that divides them still weighs the
    microbatches as one batch."""
    pm = build_parallel_model(parity_config(), _one_rank(), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for rows, microbatches in [(4, 3), (5, 4), (4, 0)]:
        tokens = torch.randint(SHAPE.vocab_size, (rows, 16), generator=gen)
        with pytest.raises(PartitaError, match=rf"{microbatches} microbatches do not "
                                               rf"divide this rank's batch of {rows} rows"):
            pm.runner.train(tokens, tokens, microbatches)
    tokens = torch.randint(SHAPE.vocab_size, (4, 16), generator=gen)
    losses = []
    for microbatches in (1, 2, 4):
        losses.append(pm.runner.train(tokens, tokens, microbatches))
        pm.dp.finish_grad_sync()
        pm.dp.zero_grad()
    assert losses == pytest.approx([losses[0]] * 3, rel=1e-12)


@pytest.mark.parametrize("layout", [{}, {"zero_stage": 1}])
def test_blocks_in_a_module_list_are_refused_naming_the_fix(layout):
    with torch.device("meta"):
        model = ListLM()
    with pytest.raises(PartitaError, match=r"ListLM\.layers \(ModelPlan\.blocks\), but there "
                                           r"is a ModuleList there.*nn\.ModuleDict"):
        parallelize(model, _plan(), parity_config(parallel=layout), _one_rank(),
                    torch.device("cpu"))


def test_blocks_the_model_lacks_are_refused():
    with torch.device("meta"):
        model = ListLM()
    with pytest.raises(PartitaError, match=r"ListLM\.blocks \(ModelPlan\.blocks\), but there "
                                           r"is nothing there"):
        parallelize(model, _plan(blocks="blocks"), parity_config(), _one_rank(),
                    torch.device("cpu"))


def test_a_pattern_matching_no_module_is_refused_naming_the_closest():
    with torch.device("meta"):
        model = ListLM()
    typo = {k.replace("layers.", "layer."): v for k, v in _plan().roles.items()}
    with pytest.raises(PartitaError, match=r"3 pattern\(s\) that match no module of ListLM: "
                                           r"'layer\.\*\.up' \(closest modules: layers\.\*\.up"):
        check_patterns_match(model, _plan(roles=typo))
    check_patterns_match(model, _plan())


@pytest.mark.parametrize("changes", [
    {}, {"tie_embeddings": True}, {"flavour": "gpt2"},
    {"n_experts": 4, "moe_every": 1}, {"n_experts": 4, "moe_every": 2},
])
def test_the_built_in_plans_match_their_models(changes):
    """Every block a mixture of experts: the dense MLP's patterns name nothing, by design."""
    cfg = dataclasses.replace(SHAPE, **changes)
    model = build_model(cfg, "meta")
    check_patterns_match(model, model.plan())


def test_the_llama_plan_matches_its_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    model, plan = llama_model(config)
    check_patterns_match(model, plan)
