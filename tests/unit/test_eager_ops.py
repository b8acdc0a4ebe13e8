"""The planner's table of partita's eager operations (`planner.eager_ops`) against a
count of the real model: operations and the bytes its elementwise operations move, per
block and outside the blocks, forward and backward."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from partita.layout import Layout
from partita.loss import cross_entropy
from partita.models.model_config import ModelConfig
from partita.models.transformer import Transformer
from partita.planner import eager_ops
from partita.planner.model_shape import PlanModel

TOL = 0.05  # a few operations of slack: a refactor that adds one view need not fail


class _Count(TorchDispatchMode):
    """Operations dispatched, and bytes read and written by those that are neither a
    GEMM, attention nor a view (what `eager_ops.BLOCK_BYTES` describes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        name = func.overloadpacket.__name__
        self.names[name] += 1
        if name not in eager_ops.NOT_ELEMENTWISE:
            self.bytes += sum(t.numel() * t.element_size()
                              for t in tree_leaves((args, kwargs, out))
                              if isinstance(t, torch.Tensor))
        return out


def _count(cfg: ModelConfig, batch: int, seq: int, dtype: torch.dtype):
    torch.manual_seed(0)
    model = Transformer(cfg).to(dtype)
    tokens = torch.randint(cfg.vocab_size, (batch, seq + 1))
    forward, backward = _Count(), _Count()
    with forward:
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    with backward:
        loss.backward()
    return forward, backward


def _per_block(cfg: ModelConfig, batch=2, seq=16, dtype=torch.float32):
    """(block, edges): each a dict of fwd/bwd operations and bytes per token."""
    one = _count(ModelConfig(**{**cfg.__dict__, "n_layers": 1}), batch, seq, dtype)
    two = _count(ModelConfig(**{**cfg.__dict__, "n_layers": 2}), batch, seq, dtype)
    tokens = batch * seq
    block, edges = {}, {}
    for i, pass_ in enumerate(("fwd", "bwd")):
        block[f"{pass_}_ops"] = two[i].ops - one[i].ops
        block[f"{pass_}_bytes"] = (two[i].bytes - one[i].bytes) / tokens
        edges[f"{pass_}_ops"] = one[i].ops - block[f"{pass_}_ops"]
    return block, edges


BASE = dict(vocab_size=64, dim=32, n_heads=4, max_seq_len=16)
FLAVOURS = {"llama": dict(n_kv_heads=2), "gpt2": dict(flavour="gpt2", tie_embeddings=True)}


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_block_and_edge_operations_match_the_model(flavour, dtype, attention):
    cfg = ModelConfig(n_layers=1, attention=attention, **BASE, **FLAVOURS[flavour])
    block, edges = _per_block(cfg, dtype=dtype)
    model = PlanModel("t", cfg)
    fwd, bwd = eager_ops.block_ops(model, Layout(), dtype.itemsize, attention == "explicit")
    assert block["fwd_ops"] == pytest.approx(fwd, rel=TOL)
    assert block["bwd_ops"] == pytest.approx(bwd, rel=TOL)
    fwd, bwd = eager_ops.edge_ops(model, dtype.itemsize)
    assert edges["fwd_ops"] == pytest.approx(fwd, rel=TOL, abs=2)
    assert edges["bwd_ops"] == pytest.approx(bwd, rel=TOL, abs=2)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_block_elementwise_bytes_match_the_model(flavour, dtype, attention):
    """Explicit scores add their width-h pieces (`block_bytes`) and the bias add and
    softmax over the scores, which `compute.attention_core` prices (heads x seq scores
    per token at the measured preset's bytes per 16-bit score)."""
    from partita.planner import Assumptions

    cfg = ModelConfig(n_layers=1, attention=attention, **BASE, **FLAVOURS[flavour])
    block, _ = _per_block(cfg, dtype=dtype)
    explicit = attention == "explicit"
    fwd, bwd = eager_ops.block_bytes(PlanModel("t", cfg), Layout(), dtype.itemsize, explicit)
    if explicit:
        a, scores = Assumptions.measured_cpu(), cfg.n_heads * 16  # per token at seq 16
        fwd += a.eager_softmax_bytes_fwd * dtype.itemsize / 2 * scores
        bwd += a.eager_softmax_bytes_bwd * dtype.itemsize / 2 * scores
    assert block["fwd_bytes"] == pytest.approx(fwd, rel=0.1)
    assert block["bwd_bytes"] == pytest.approx(bwd, rel=0.1)


def test_moe_block_operations_grow_with_local_experts():
    counts = {}
    for experts in (4, 8):
        cfg = ModelConfig(n_layers=1, n_experts=experts, top_k=2, **BASE, n_kv_heads=2)
        # Enough tokens that every expert receives some.
        counts[experts] = _per_block(cfg, batch=4, seq=16)[0]
        fwd, bwd = eager_ops.block_ops(PlanModel("t", cfg), Layout())
        assert counts[experts]["fwd_ops"] == pytest.approx(fwd, rel=TOL)
        assert counts[experts]["bwd_ops"] == pytest.approx(bwd, rel=TOL)
    # Under ep = 2 a rank holds half the experts: the planner counts half of them.
    cfg = ModelConfig(n_layers=1, n_experts=8, top_k=2, **BASE, n_kv_heads=2)
    assert eager_ops.block_ops(PlanModel("t", cfg), Layout(dp=2, ep=2))[0] == \
        eager_ops.block_ops(PlanModel("t", ModelConfig(
            n_layers=1, n_experts=4, top_k=2, **BASE, n_kv_heads=2)), Layout())[0]


def test_step_time_prices_every_eager_operation_where_the_device_pays_for_them():
    """A device with `eager_op_s` adds that much per counted operation: blocks and
    edges forward and backward, and the optimizer step; the catalog GPUs (0) do not."""
    from dataclasses import replace

    from partita.planner import Assumptions
    from partita.planner.hardware import GPUS, Cluster
    from partita.planner.precision import Precision
    from partita.planner.timing import step_time

    cfg = ModelConfig(n_layers=3, **BASE, n_kv_heads=2)
    model, layout, a = PlanModel("t", cfg), Layout(), Assumptions.measured_cpu()
    base = replace(GPUS["H100"], eager_op_s=0.0)
    times = {op: step_time(model, layout, Cluster(replace(base, eager_op_s=op), 1, 8), 16,
                           2, Precision.fp32(), a)["step_s"] for op in (0.0, 1e-5)}
    fwd, bwd = eager_ops.block_ops(model, layout)
    edge = sum(eager_ops.edge_ops(model))
    step = eager_ops.step_ops(model.total_params(), 4, a)  # one bucket
    assert step == sum(eager_ops.STEP_OPS)
    ops = 2 * (3 * (fwd + bwd) + edge) + step  # 2 microbatches
    assert times[1e-5] - times[0.0] == pytest.approx(ops * 1e-5, rel=1e-6)
