"""A model partita did not write -- transformers' Llama -- through the same `parallelize`.

Its plan lives in `partita.models.hf_llama`; the attention, MLP and decoder-layer code
that runs is transformers' own. Every layout (dp=2 with ZeRO 0-3, tp=2 with and without
sequence parallelism, pp=2) must match one process in float64 within 1e-10: the loss
of every step, the gradient norm, and every final parameter. The layouts and the
one-process reference go through partita.testing's harness (`Case(model=...)`), the
same path as partita's own model; one more test anchors that reference to a plain
PyTorch loop over transformers' own module (torch.optim.AdamW, clip_grad_norm_).

transformers' RMSNorm and rotary embedding compute in float32 even in a float64 model,
so this model is less precise than a float64 one; it does not loosen the comparison,
because one process and every layout run the same ops on the same values: a float32
rounding differs only where the float64 inputs already differ (~1e-16), which almost
never moves a float32 result.

The tensor-parallel communication of one step must equal that of partita's own
transformer of the same shape: the region is entered once per attention and MLP module
even though transformers calls attention by keyword, and under sequence parallelism the
attention sees the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partita.config import Config
from partita.mesh import Mesh
from partita.models.transformer import Transformer
from partita.parallelize import parallelize
from partita.testing import (
    PARITY_MODEL,
    Case,
    assert_parity,
    check_layouts,
    parity_config,
    reference,
    run_distributed,
    token_batch,
)

transformers = pytest.importorskip("transformers")
hf_llama = pytest.importorskip("partita.models.hf_llama")

STEPS, SEED = 3, 5
LAYOUTS = {
    "dp2-zero0": dict(dp=2, zero_stage=0),
    "dp2-zero1": dict(dp=2, zero_stage=1),
    "dp2-zero2": dict(dp=2, zero_stage=2),
    "dp2-zero3": dict(dp=2, zero_stage=3),
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2-1f1b": dict(pp=2),
    "dp2-zero3-recompute": dict(dp=2, zero_stage=3, recompute="full"),
}


def llama_config(impl: str = "sdpa"):
    """The parity model's shape as a transformers LlamaConfig."""
    m = PARITY_MODEL
    return transformers.LlamaConfig(
        vocab_size=m["vocab_size"], hidden_size=m["dim"], intermediate_size=64,
        num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
        num_key_value_heads=m["n_kv_heads"], max_position_embeddings=64,
        attn_implementation=impl)


def hf_model():
    """transformers' Llama on the meta device, with its plan (the harness's ModelFn)."""
    return hf_llama.llama_model(llama_config(), seed=SEED)


def config(**parallel) -> Config:
    return parity_config(parallel=dict(bucket_mb=0.01, **parallel),  # several buckets
                         train=dict(microbatches=2))


def test_hf_llama_matches_one_process_in_every_layout():
    cases = [Case(name, config(**lay), params=True, model=hf_model)
             for name, lay in LAYOUTS.items()]
    check_layouts(cases, world=2, steps=STEPS)


def test_the_reference_is_plain_pytorch_over_transformers_modules():
    """The harness's one-process run of the adapter equals a hand-written loop: the
    whole batch, torch.optim.AdamW (no decay on vectors), clip_grad_norm_."""
    cfg = config()
    ref = reference(cfg, STEPS, params=True, model=hf_model)
    model, _ = hf_llama.llama_model(llama_config(), seed=SEED, device="cpu")
    model = model.to(torch.float64)
    params = list(model.parameters())
    t = cfg.train
    groups = [{"params": [p for p in params if p.ndim >= 2]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            weight_decay=t.weight_decay)
    losses, norms = [], []
    for step in range(STEPS):
        tokens = token_batch(step, t.global_batch, cfg.data.seq_len, cfg.model.vocab_size)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, t.grad_clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert_parity({"losses": ref["losses"], "norms": ref["norms"]},
                  {"losses": losses, "norms": norms}, 1e-10, "harness vs plain PyTorch")
    assert_parity({n: v for n, (_, v) in ref["params"].items()},
                  {n: p.detach() for n, p in model.named_parameters()}, 1e-10,
                  "harness vs plain PyTorch, final parameters")
    assert losses[-1] < losses[0]


def tensor_comm(rank: int, world: int, sp: bool) -> dict:
    """(op -> calls, bytes) on the tensor group for one training step, HF vs partita."""
    cfg = parity_config(parallel=dict(tp=2, sequence_parallel=sp))
    out = {}
    hf, plan = hf_model()
    with torch.device("meta"):
        own = Transformer(plan.shape)
    tokens = token_batch(0, 4, cfg.data.seq_len, PARITY_MODEL["vocab_size"])
    for name, (model, model_plan) in {"hf": (hf, plan), "partita": (own, own.plan())}.items():
        mesh = Mesh(cfg.layout(world), rank, world)
        pm = parallelize(model, model_plan, cfg, mesh, torch.device("cpu"))
        mesh.counter.reset()
        pm.runner.train(tokens[:, :-1], tokens[:, 1:], 1)
        out[name] = {op: (mesh.counter.calls[(p, op)], mesh.counter.sent[(p, op)])
                     for (p, op) in mesh.counter.calls if p == "tensor"}
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_hf_llama_tensor_comm_equals_partita_model(sp):
    for comm in run_distributed(tensor_comm, 2, args=(sp,), timeout=240):
        assert comm["hf"] == comm["partita"], (comm["hf"], comm["partita"])
        # Not vacuous: forward and backward of 2 blocks communicated over the group.
        assert sum(calls for calls, _ in comm["hf"].values()) >= 8


def test_attention_called_by_keyword_enters_region_once():
    """The pre-hook finds a region input passed by keyword; without it each of q, k, v
    would enter the region on its own."""
    from partita.tensor_parallel.layers import _ENTERED, region_pre_hook

    class Comm:
        size, index = 2, 0

    class Attn(torch.nn.Module):
        def forward(self, hidden_states, position_embeddings=None):
            return hidden_states

    hook = region_pre_hook(Comm(), sequence_parallel=False)
    x = torch.randn(2, 3, requires_grad=True)
    pos = (torch.ones(1), torch.ones(1))
    args, kwargs = hook(Attn(), (), {"hidden_states": x, "position_embeddings": pos})
    assert args == () and kwargs["position_embeddings"] is pos
    assert getattr(kwargs["hidden_states"], _ENTERED, None) is not None


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_adapter_computes_what_transformers_computes(impl):
    """Same weights, same logits as transformers' own LlamaForCausalLM (the adapter adds
    the position embeddings and, for eager attention, the causal mask by hook)."""
    config = llama_config(impl)
    model, plan = hf_llama.llama_model(config, seed=SEED, device="cpu")
    model = model.to(torch.float64)
    reference = transformers.LlamaForCausalLM(config).to(torch.float64)
    state = {(n if n.startswith("lm_head") else f"model.{n}"): p.detach()
             for n, p in model.named_parameters()}
    reference.load_state_dict(state, strict=True)
    tokens = token_batch(0, 4, 16, PARITY_MODEL["vocab_size"])[:, :-1]
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens).logits)
    assert plan.block_names(model) == ["layers.0", "layers.1"]
