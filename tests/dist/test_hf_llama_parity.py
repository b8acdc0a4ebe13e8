"""A model partita did not write -- transformers' Llama -- through the same `parallelize`.

Its plan lives in `partita.models.hf_llama`; the attention, MLP and decoder-layer code
that runs is transformers' own. Every layout (dp=2 with ZeRO 0-3, tp=2 with and without
sequence parallelism, pp=2) must match one process in float64 within 1e-10: the loss
of every step, the gradient norm, and every final parameter. One spawned world of two
ranks runs all layouts.

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

import traceback

import pytest
import torch
import torch.nn.functional as F

from partita.config import Config
from partita.weights import full_state_dict
from partita.mesh import Mesh
from partita.models.transformer import Transformer
from partita.parallelize import parallelize
from partita.testing import assert_parity, run_distributed

transformers = pytest.importorskip("transformers")
hf_llama = pytest.importorskip("partita.models.hf_llama")

SEQ, VOCAB, LR, STEPS, BATCH, SEED = 16, 64, 3e-3, 3, 4, 5
TOL = 1e-10
CASES = [
    dict(id="dp2-zero0", dp=2, zero=0, m=2),
    dict(id="dp2-zero1", dp=2, zero=1, m=2),
    dict(id="dp2-zero2", dp=2, zero=2, m=2),
    dict(id="dp2-zero3", dp=2, zero=3, m=2),
    dict(id="tp2", tp=2, m=2),
    dict(id="tp2-sp", tp=2, sp=True, m=2),
    dict(id="pp2-1f1b", pp=2, m=2),
]


def llama_config(impl: str = "sdpa"):
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        attn_implementation=impl)


def make_config(case: dict) -> Config:
    cfg = Config()
    cfg.data.seq_len = SEQ
    cfg.train.global_batch = BATCH
    cfg.train.microbatches = case.get("m", 1)
    cfg.train.dtype = "float64"
    cfg.train.lr = LR
    cfg.parallel.dp = case.get("dp", 1)
    cfg.parallel.tp = case.get("tp", 1)
    cfg.parallel.pp = case.get("pp", 1)
    cfg.parallel.zero_stage = case.get("zero", 0)
    cfg.parallel.sequence_parallel = case.get("sp", False)
    cfg.parallel.bucket_mb = 0.01  # several buckets
    return cfg


def batch(step: int) -> torch.Tensor:
    """Learnable sequences (next = 5 * token + 3 mod vocab), so the loss moves."""
    gen = torch.Generator().manual_seed(2000 + step)
    tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (BATCH,), generator=gen)
    for t in range(SEQ):
        tokens[:, t + 1] = (5 * tokens[:, t] + 3) % VOCAB
    return tokens


def _mesh(cfg: Config, rank: int, world: int) -> Mesh:
    return Mesh(cfg.layout(world), rank, world)


def train_case(rank: int, world: int, case: dict) -> dict:
    cfg = make_config(case)
    mesh = _mesh(cfg, rank, world)
    model, plan = hf_llama.llama_model(llama_config(case.get("impl", "sdpa")), seed=SEED)
    pm = parallelize(model, plan, cfg, mesh, torch.device("cpu"))
    dp, loss_comm = pm.dp, mesh.comm("loss_average")

    def mean(local: float) -> float:
        (total,) = loss_comm.all_reduce_scalars([local])
        (total,) = mesh.comm("pipeline").all_reduce_scalars([total])
        return total / loss_comm.size

    losses, norms = [], []
    for step in range(STEPS):
        tokens = batch(step).chunk(loss_comm.size)[loss_comm.index]
        local = pm.runner.train(tokens[:, :-1], tokens[:, 1:], cfg.train.microbatches)
        dp.finish_grad_sync()
        norms.append(dp.clip_grad_norm_(1.0))
        losses.append(mean(local))
        dp.step(LR)
        dp.zero_grad()
    return {"losses": losses, "norms": norms, "params": full_state_dict(pm)}


def reference() -> dict:
    """The same training in one process: transformers' modules, whole batch at once."""
    model, _ = hf_llama.llama_model(llama_config(), seed=SEED, device="cpu")
    model = model.to(torch.float64)
    params = list(model.parameters())
    t = Config().train
    groups = [{"params": [p for p in params if p.ndim >= 2]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(t.beta1, t.beta2), eps=t.eps,
                            weight_decay=t.weight_decay)
    losses, norms = [], []
    for step in range(STEPS):
        tokens = batch(step)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def tensor_comm(rank: int, world: int, sp: bool) -> dict:
    """(op -> calls, bytes) on the tensor group for one training step, HF vs partita."""
    cfg = make_config(dict(tp=2, sp=sp, m=1))
    out = {}
    config = llama_config()
    hf, plan = hf_llama.llama_model(config, seed=SEED)
    with torch.device("meta"):
        own = Transformer(plan.shape)
    for name, (model, model_plan) in {"hf": (hf, plan), "partita": (own, own.plan())}.items():
        mesh = _mesh(cfg, rank, world)
        pm = parallelize(model, model_plan, cfg, mesh, torch.device("cpu"))
        tokens = batch(0)
        mesh.counter.reset()
        pm.runner.train(tokens[:, :-1], tokens[:, 1:], 1)
        out[name] = {op: (mesh.counter.calls[(p, op)], mesh.counter.sent[(p, op)])
                     for (p, op) in mesh.counter.calls if p == "tensor"}
    return out


def _catching(fn, *args):
    """fn's result, or its traceback as a string: a case that fails on every rank alike
    fails its own test, not the whole world's."""
    try:
        return fn(*args)
    except Exception:
        return traceback.format_exc()


def run_world(rank: int, world: int) -> dict:
    results = {case["id"]: _catching(train_case, rank, world, case) for case in CASES}
    comm = {sp: _catching(tensor_comm, rank, world, sp) for sp in (False, True)}
    return {"results": results, "comm": comm}


def _result(value):
    if isinstance(value, str):
        pytest.fail(value)
    return value


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(run_world, 2, timeout=240)


@pytest.fixture(scope="module")
def ref() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_hf_llama_matches_one_process(world, ref, case):
    got = _result(world[0]["results"][case["id"]])
    assert_parity({"losses": got["losses"], "norms": got["norms"]},
                  {"losses": ref["losses"], "norms": ref["norms"]}, TOL, case["id"])
    assert set(got["params"]) == set(ref["params"])
    assert_parity(got["params"], ref["params"], TOL, f"{case['id']} final parameters")
    # The weights moved: equal final parameters are not equal initial ones.
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_hf_llama_tensor_comm_equals_partita_model(world, sp):
    for rank in (0, 1):
        comm = _result(world[rank]["comm"][sp])
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
    tokens = batch(0)[:, :-1]
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens).logits)
    assert plan.block_names(model) == ["layers.0", "layers.1"]
