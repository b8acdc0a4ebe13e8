"""A model and plan that tensor or pipeline parallelism cannot run are refused before
anything changes, naming what is wrong: a colwise layer without its rowwise partner (or
the reverse), a parameter shared by modules that would be split apart (plain PyTorch
weight tying), a model without the embed() / head() a pipeline calls. No processes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partita.comm import CommCounter, GroupComm
from partita.errors import PartitaError
from partita.models import plan as R
from partita.models.model_config import ModelConfig
from partita.models.transformer import build_model
from partita.pipeline.stage import check_stage_model, plan_stages
from partita.tensor_parallel import apply_tensor_parallel

SHAPE = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=128,
                    max_seq_len=16, flavour="gpt2")


class Attn(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.head_dim = d // h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attn(d, h)
        self.mlp = nn.Module()
        self.mlp.up, self.mlp.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp.down(F.gelu(self.mlp.up(self.ln2(x))))


class UserLM(nn.Module):
    """A GPT-2-style model as a user writes it; `tie` ties the head the PyTorch way."""

    def __init__(self, tie: bool = False, pipeline_methods: bool = True) -> None:
        super().__init__()
        d = SHAPE.dim
        self.tok, self.pos = nn.Embedding(SHAPE.vocab_size, d), nn.Embedding(16, d)
        self.blocks = nn.ModuleDict({str(i): Block(d, SHAPE.n_heads)
                                     for i in range(SHAPE.n_layers)})
        self.lnf, self.out = nn.LayerNorm(d), nn.Linear(d, SHAPE.vocab_size, bias=False)
        if tie:
            self.out.weight = self.tok.weight
        if pipeline_methods:
            self.embed = lambda x: self.tok(x) + self.pos(torch.arange(x.shape[1]))
            self.head = lambda h: self.out(self.lnf(h))


def user_plan(drop: str = "") -> R.ModelPlan:
    roles = {"blocks.*.attn.q": R.COLWISE, "blocks.*.attn.k": R.COLWISE,
             "blocks.*.attn.v": R.COLWISE, "blocks.*.attn.o": R.ROWWISE,
             "blocks.*.mlp.up": R.COLWISE, "blocks.*.mlp.down": R.ROWWISE,
             "tok": R.VOCAB_EMBEDDING, "out": R.VOCAB_HEAD, "blocks.*.ln1": R.NORM,
             "blocks.*.ln2": R.NORM, "lnf": R.NORM, "pos": R.POSITIONS}
    roles.pop(drop, None)
    return R.ModelPlan(roles=roles, blocks="blocks", embedding="tok", head=("lnf", "out"),
                       init=None, shape=SHAPE)


def tp2(rank: int = 0) -> GroupComm:
    """A tp=2 comm without processes: applying issues no collective."""
    return GroupComm(None, [0, 1], rank, "tensor", CommCounter())


def test_shared_parameters_lists_every_name_of_a_shared_tensor() -> None:
    assert R.shared_parameters(UserLM()) == []
    assert R.shared_parameters(UserLM(tie=True)) == [["tok.weight", "out.weight"]]


@pytest.mark.parametrize("drop,message", [
    ("blocks.*.mlp.down", r"blocks\.0\.mlp\.up colwise but blocks\.0\.mlp has no rowwise "
                          r"layer \(its nn\.Linear without a role: blocks\.0\.mlp\.down\) "
                          r"\(and 1 more module like it\)"),
    ("blocks.*.mlp.up", r"blocks\.0\.mlp\.down rowwise but blocks\.0\.mlp has no colwise"),
    ("blocks.*.attn.o", r"blocks\.0\.attn\.q, blocks\.0\.attn\.k, blocks\.0\.attn\.v "
                        r"colwise but blocks\.0\.attn has no rowwise"),
    ("blocks.*.attn.k", r"blocks\.0\.attn\.k in blocks\.0\.attn beside its split layers "
                        r"has no role"),
])
def test_a_split_layer_without_its_partner_is_named(drop: str, message: str) -> None:
    model = UserLM()
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(PartitaError, match=message):
        apply_tensor_parallel(model, user_plan(drop), tp2())
    # Refused before any module was swapped: the model is still the user's.
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_a_plan_with_every_partner_applies() -> None:
    for rank in (0, 1):
        apply_tensor_parallel(UserLM(), user_plan(), tp2(rank))


@pytest.mark.parametrize("role_of_out", [R.VOCAB_HEAD, None])
def test_weight_tying_the_pytorch_way_is_refused_under_tp(role_of_out: str | None) -> None:
    """The embedding's shard would become a tensor of its own, untied from the head."""
    plan = user_plan("" if role_of_out else "out")
    with pytest.raises(PartitaError, match=r"tok\.weight and out\.weight are one tensor.*"
                                           r"ModelPlan\.tied_head"):
        apply_tensor_parallel(UserLM(tie=True), plan, tp2())


def test_sharing_between_unsplit_modules_is_kept_under_tp() -> None:
    model = UserLM()
    model.blocks["1"].ln1.weight = model.blocks["0"].ln1.weight  # norms: replicated
    apply_tensor_parallel(model, user_plan(), tp2())
    assert model.blocks["1"].ln1.weight is model.blocks["0"].ln1.weight


def test_a_pipeline_refuses_a_tensor_shared_across_stages() -> None:
    layout = plan_stages(SHAPE, 2, 1)
    with pytest.raises(PartitaError, match=r"tok\.weight \(stage 0\), out\.weight \(stage 1\)"
                                           r".*ModelPlan\.tied_head"):
        check_stage_model(UserLM(tie=True), user_plan(), layout)
    model = UserLM()
    model.blocks["1"].mlp.up.weight = model.blocks["0"].mlp.up.weight
    with pytest.raises(PartitaError, match=r"blocks\.0\.mlp\.up\.weight \(stage 0\), "
                                           r"blocks\.1\.mlp\.up\.weight \(stage 1\)"):
        check_stage_model(model, user_plan(), layout)
    check_stage_model(model, user_plan(), plan_stages(SHAPE, 1, 1))  # one stage holds both


def test_a_pipeline_names_the_methods_it_needs() -> None:
    layout = plan_stages(SHAPE, 2, 1)
    with pytest.raises(PartitaError, match=r"UserLM has no embed\(\) and no head\(\).*"
                                           r"parallel\.pp=1"):
        check_stage_model(UserLM(pipeline_methods=False), user_plan(), layout)
    model = UserLM()
    model.blocks = nn.ModuleList(model.blocks.values())
    with pytest.raises(PartitaError, match=r"nn\.ModuleDict with keys '0'\.\.'1'.*"
                                           r"it is ModuleList"):
        check_stage_model(model, user_plan(), layout)
    check_stage_model(UserLM(), user_plan(), layout)


def test_partitas_own_tied_model_passes_both_checks() -> None:
    cfg = dataclasses.replace(SHAPE, tie_embeddings=True, n_layers=4)
    model = build_model(cfg, "meta")
    check_stage_model(model, model.plan(), plan_stages(cfg, 2, 2))
    apply_tensor_parallel(model, model.plan(), tp2())
