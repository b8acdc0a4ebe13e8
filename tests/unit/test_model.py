"""The single-device model: masking, attention variants, deterministic sliceable init."""

import dataclasses

import pytest
import torch

from partita.errors import PartitaError
from partita.models import MODELS, ModelConfig, Transformer, build_model, get_model_config
from partita.models.param_init import CHUNK, InitRule, init_flat_slice, init_full
from partita.models.transformer import transformer_init
from partita.sharding import ShardInfo, init_shard


@pytest.mark.parametrize("flavour", ["llama", "gpt2"])
def test_causal_future_tokens_do_not_change_past_logits(flavour, tiny_model):
    model = build_model(dataclasses.replace(tiny_model, flavour=flavour), dtype=torch.float64)
    x = torch.randint(0, 64, (2, 12))
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 1) % 64
    a, b = model(x), model(y)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-12)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_gqa_with_all_kv_heads_equals_multi_head_attention(tiny_model):
    mha = build_model(dataclasses.replace(tiny_model, n_kv_heads=None), dtype=torch.float64)
    gqa = build_model(dataclasses.replace(tiny_model, n_kv_heads=4), dtype=torch.float64)
    x = torch.randint(0, 64, (2, 10))
    assert torch.equal(mha(x), gqa(x))


def test_attention_matches_explicit_softmax(tiny_model):
    model = build_model(tiny_model, dtype=torch.float64)
    attn = model.blocks["0"].attn
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    q = attn.wq(x).view(1, 6, 4, 8)
    k = attn.wk(x).view(1, 6, 2, 8)
    v = attn.wv(x).view(1, 6, 2, 8)
    from partita.models.rotary import apply_rotary, rotary_tables

    cos, sin = rotary_tables(6, 8, tiny_model.rope_theta, x.device, x.dtype)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5
    scores = scores.masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(1, 6, 32)
    assert torch.allclose(attn(x), attn.wo(out), atol=1e-12)


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt2"])
def test_meta_init_equals_eager_init(name):
    cfg = get_model_config(name)
    eager = Transformer(cfg)
    from_meta = build_model(cfg)
    for (n, a), (_, b) in zip(eager.state_dict().items(), from_meta.state_dict().items()):
        assert torch.equal(a, b), n


def test_init_depends_on_name_and_seed_only(tiny_model):
    model = build_model(tiny_model)
    again = build_model(tiny_model)
    other_seed = build_model(dataclasses.replace(tiny_model, seed=1))
    w = "blocks.0.attn.wq.weight"
    assert torch.equal(dict(model.named_parameters())[w], dict(again.named_parameters())[w])
    assert not torch.equal(dict(model.named_parameters())[w],
                           dict(other_seed.named_parameters())[w])
    p = dict(model.named_parameters())
    assert not torch.equal(p["blocks.0.attn.wq.weight"], p["blocks.1.attn.wq.weight"])
    assert torch.equal(p["norm.weight"], torch.ones(32))


def test_any_flat_slice_equals_the_slice_of_the_full_tensor():
    rule = InitRule("normal", 0.02)
    numel = 3 * CHUNK + 123
    full = init_full(rule, 7, "w", (numel,))
    for start, stop in [(0, 10), (CHUNK - 5, CHUNK + 5), (2 * CHUNK + 1, numel), (17, 17)]:
        assert torch.equal(init_flat_slice(rule, 7, "w", start, stop), full[start:stop])


def test_tensor_parallel_style_shards_equal_slices_of_the_single_device_init(tiny_model):
    model = build_model(tiny_model)
    for name, param in model.named_parameters():
        if param.ndim != 2:
            continue
        for dim in (0, 1):
            half = param.shape[dim] // 2
            info = ShardInfo(name, tuple(param.shape), dim, half, param.shape[dim])
            assert torch.equal(init_shard(transformer_init(tiny_model), info), param.narrow(dim, half, half)), name
        # Cut along both dimensions (an expert stack split over ep and over tp).
        rows, cols = param.shape
        info = ShardInfo(name, tuple(param.shape), 1, cols // 2, cols, more=((0, 1, rows - 1),))
        assert info.local_shape() == (rows - 2, cols - cols // 2)
        assert torch.equal(init_shard(transformer_init(tiny_model), info),
                           param[1:rows - 1, cols // 2:]), name


def test_parameter_counts_match_the_published_sizes():
    assert abs(MODELS["llama3-8b"].num_params() / 8.03e9 - 1) < 0.01
    assert abs(MODELS["llama3-70b"].num_params() / 70.6e9 - 1) < 0.01
    assert abs(MODELS["llama3-405b"].num_params() / 405.9e9 - 1) < 0.01
    assert abs(MODELS["gpt3-175b"].num_params() / 174.6e9 - 1) < 0.01
    assert abs(MODELS["mistral-7b"].num_params() / 7.25e9 - 1) < 0.01
    assert abs(MODELS["qwen2.5-7b"].num_params() / 7.62e9 - 1) < 0.01  # with its biases
    meta = build_model(get_model_config("llama3-8b"), device="meta")
    assert sum(p.numel() for p in meta.parameters()) == MODELS["llama3-8b"].num_params()


def test_bad_shapes_explain_themselves():
    with pytest.raises(PartitaError, match="not divisible by model.n_heads"):
        ModelConfig(dim=30, n_heads=4)
    with pytest.raises(PartitaError, match="n_kv_heads"):
        ModelConfig(dim=32, n_heads=4, n_kv_heads=3)
    # Rotary turns pairs of dimensions: an odd head size is refused up front (it failed
    # in the first forward pass); GPT-2's learned positions take any size.
    with pytest.raises(PartitaError, match="heads of 9 dimensions.*even size"):
        ModelConfig(dim=36, n_heads=4)
    ModelConfig(dim=36, n_heads=4, flavour="gpt2", n_kv_heads=None)
    with pytest.raises(PartitaError, match="Known models"):
        get_model_config("llama-9000")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_rotary_rounds_once_forward_and_backward(dtype):
    """Eager 16-bit q and k rotate in float32 (`RotateInFloat32`): each output and each
    input gradient is the float64 rotation rounded once, within half a step of its dtype."""
    from partita.models.rotary import rotary_tables, rotate_pairs

    b, s, h, d = 2, 16, 4, 8
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10  # one unit in the last place, relative
    cos, sin = rotary_tables(s, d, 10000.0, torch.device("cpu"), dtype)
    x = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(0)).to(dtype)
    grad = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    x.requires_grad_()
    (y,) = rotate_pairs((x,), cos, sin)
    y.backward(grad)
    exact = x.detach().double().requires_grad_()
    (y64,) = rotate_pairs((exact,), cos.double(), sin.double())
    y64.backward(grad.double())
    for got, ref in ((y, y64), (x.grad, exact.grad)):
        assert got.dtype == dtype
        assert torch.all((got.double() - ref).abs() <= ref.abs() * step / 2 * 1.01 + 1e-6)


def test_compiled_attentions_halves_rotate_q_and_k_to_the_same_scores():
    """Compiled attention takes q and k with each head's pairs reordered to halves (its
    weight rows reordered) and rotates those: the rotated values are the pairs' own,
    reordered, so every q . k, the only use attention makes of them, is unchanged."""
    from partita.models.rotary import (
        _HalvesLinear,
        pairs_as_halves,
        rotary_tables,
        rotate_halves,
        rotate_pairs,
    )

    torch.manual_seed(0)
    b, s, heads, d = 2, 6, 3, 8
    linear = torch.nn.Linear(16, heads * d, bias=True, dtype=torch.float64)
    x = torch.randn(b, s, 16, dtype=torch.float64)
    cos, sin = rotary_tables(s, d, 10000.0, "cpu", torch.float64, offset=3)
    (pairs,) = rotate_pairs((linear(x).view(b, s, heads, d),), cos, sin)
    (halves,) = rotate_halves((pairs_as_halves(linear, x, d).view(b, s, heads, d),), cos, sin)
    order = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
    torch.testing.assert_close(halves, pairs[..., order], rtol=1e-13, atol=1e-13)
    scores = torch.einsum("bshd,bthd->bhst", pairs, pairs)
    torch.testing.assert_close(torch.einsum("bshd,bthd->bhst", halves, halves), scores,
                               rtol=1e-12, atol=1e-12)
    # A tensor-parallel column shard (whole heads) goes the same way, its input
    # entered into the region first; a projection with hooks keeps its own forward.
    from partita.comm import CommCounter, GroupComm
    from partita.models.rotary import plain_projection
    from partita.tensor_parallel import ColumnParallelLinear

    shard = ColumnParallelLinear(linear, d, 3 * d, GroupComm(None, [0], 0, "tp", CommCounter()),
                                 sequence_parallel=False)
    assert plain_projection(linear) and plain_projection(shard)
    torch.testing.assert_close(pairs_as_halves(shard, x, d).view(b, s, 2, d),
                               shard(x).view(b, s, 2, d)[..., order], rtol=1e-13, atol=1e-13)
    shard.register_forward_hook(lambda *_: None)
    assert not plain_projection(shard)
    # Its own backward (the reordered weight is not saved): the gradients of x, the
    # weight and the bias, against finite differences.
    small = torch.nn.Linear(4, 2 * 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x, w, b: _HalvesLinear.apply(x, w, b, 4),
        (torch.randn(3, 4, dtype=torch.float64, requires_grad=True),
         small.weight.detach().requires_grad_(), small.bias.detach().requires_grad_()))
    # Under autocast (fp32 weights, a bf16 GEMM) each gradient comes back in its input's
    # dtype, as F.linear's do; the backward's GEMMs mixed bf16 and fp32 and failed.
    x32 = torch.randn(3, 4, requires_grad=True)
    w32 = torch.randn(8, 4, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        out = _HalvesLinear.apply(x32, w32, None, 4)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert x32.grad.dtype == w32.grad.dtype == torch.float32
