"""Planner memory arithmetic against hand-computed cases (no processes, no GPU)."""

import dataclasses
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from partita.errors import PartitaError
from partita.models.catalog import MODELS
from partita.models.model_config import ModelConfig
from partita.pipeline.actions import Kind
from partita.pipeline.schedules import zb_h1_order
from partita.planner import (
    Assumptions,
    Layout,
    PlanModel,
    Precision,
    korthikanti_layer_bytes,
    layer_activation_terms,
    model_state_bytes,
    resolve_model,
    zero_state_bytes,
)
from partita.planner.activation_memory import inflight_chunks, layer_activation_bytes
from partita.planner.memory import activation_bytes, peak_stages
from partita.planner.schedule_peaks import zero_bubble_peak
from partita.planner.stage_params import stage_layers, stage_param_counts
from partita.planner.zero_buffers import padded_params, zero3_buffers

EAGER = Assumptions(attention_kernel="eager")


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_example(stage, expected_gb):
    # ZeRO paper, Fig. 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12).
    total = sum(zero_state_bytes(7.5e9, stage, 64).values())
    assert total / 1e9 == pytest.approx(expected_gb, rel=0.01)


def test_zero_stages_exact_bytes():
    p, n = 1000.0, 8
    assert zero_state_bytes(p, 0, n) == {"parameters": 2000, "gradients": 2000,
                                         "master_weights": 4000, "optimizer_states": 8000}
    assert sum(zero_state_bytes(p, 1, n).values()) == 4 * p + 12 * p / n
    assert sum(zero_state_bytes(p, 2, n).values()) == 2 * p + 14 * p / n
    assert sum(zero_state_bytes(p, 3, n).values()) == 16 * p / n
    # fp32 training keeps no master copy: 4 + 4 + 8.
    assert sum(zero_state_bytes(p, 0, 1, Precision.fp32()).values()) == 16 * p
    assert zero_state_bytes(p, 0, 1, Precision.fp32())["master_weights"] == 0
    # Gradients held and reduced in fp32 under bf16 (`precision.reduce_dtype`): 4 bytes
    # each, whole in stages 0-1 and sharded from stage 2 on.
    fp32_grads = Precision.named("bf16-fp32-grads")
    assert zero_state_bytes(p, 1, n, fp32_grads)["gradients"] == 4 * p
    assert zero_state_bytes(p, 2, n, fp32_grads)["gradients"] == 4 * p / n
    assert sum(zero_state_bytes(p, 0, n, fp32_grads).values()) == 18 * p
    with pytest.raises(PartitaError, match="bf16-fp32-grads"):
        Precision.named("bf16-fp32")
    # Offload moves master weights and moments off the GPU.
    off = zero_state_bytes(p, 1, n, offload="optimizer")
    assert off["master_weights"] == off["optimizer_states"] == 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_counts_match_model_config(name):
    model = resolve_model(name)
    assert model.total_params() == model.config.num_params()
    states = model_state_bytes(model, Layout())
    assert sum(states.values()) == 16 * model.config.num_params()


def test_tensor_parallel_divides_all_but_norms():
    model = resolve_model("llama3-8b")
    c = model.config
    norms = 2 * c.dim
    block = c.block_param_count()
    expected = c.n_layers * ((block - norms) / 2 + norms) + 2 * c.vocab_size * c.dim / 2 + c.dim
    assert stage_param_counts(model, Layout(tp=2))["dense"] == pytest.approx(expected)
    # GQA with tp above the kv heads replicates K/V projections.
    wide = stage_param_counts(model, Layout(tp=16))["dense"]
    kv = 2 * c.dim * c.head_dim * c.n_layers  # one kv head's K and V on every rank
    assert wide == pytest.approx(c.n_layers * (4096 * 4096 * 2 / 16 + 3 * 4096 * 14336 / 16
                                              + norms) + kv + 2 * c.vocab_size * c.dim / 16
                                 + c.dim)


def test_pipeline_stages_own_embedding_and_head():
    model = resolve_model("tiny")
    c = model.config
    first = stage_param_counts(model, Layout(pp=2), 0)["dense"]
    last = stage_param_counts(model, Layout(pp=2), 1)["dense"]
    assert first == 2 * c.block_param_count() + c.vocab_size * c.dim
    assert last == 2 * c.block_param_count() + c.head_param_count()
    assert first + last == c.num_params()
    # Tied embeddings: the last stage keeps its own copy of the shared matrix.
    tied = resolve_model("tiny-gpt2")
    tc = tied.config
    total = sum(stage_param_counts(tied, Layout(pp=2), s)["dense"] for s in (0, 1))
    assert total == tc.num_params() + tc.vocab_size * tc.dim


def test_stage_layers_uneven():
    assert stage_layers(126, 16) == (7,) + (8,) * 14 + (7,)
    assert stage_layers(4, 2) == (2, 2)
    assert sum(stage_layers(80, 3)) == 80


def test_zero_shards_over_data_and_context():
    model = resolve_model("tiny")
    p = model.config.num_params()
    s = model_state_bytes(model, Layout(dp=2, cp=2, zero_stage=1))
    assert s["master_weights"] == pytest.approx(4 * p / 4)
    assert s["parameters"] == 2 * p


def _gpt(dropout=0.1):
    # A GPT block as in Korthikanti et al.: LayerNorm, GELU 4h MLP, MHA, dropout.
    cfg = ModelConfig(vocab_size=51200, dim=12288, n_layers=2, n_heads=96, max_seq_len=2048,
                      flavour="gpt2", dropout=dropout)
    return PlanModel("gpt", cfg)


def test_korthikanti_hand_case():
    # GPT-3 shape, s=2048, b=1: sbh(34 + 5as/h) = 2048*12288*(34 + 80) bytes.
    assert korthikanti_layer_bytes(2048, 1, 12288, 96) == 2048 * 12288 * 114
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, t=8) == pytest.approx(
        2048 * 12288 * (10 + 24 / 8 + 80 / 8))
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, t=8, sp=True) == 2048 * 12288 / 8 * 114
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, recompute="selective") == 2048 * 12288 * 34
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, attention_kernel="flash") == 2048 * 12288 * 34
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, t=8, sp=True, recompute="full") == (
        2 * 2048 * 12288 / 8)


@pytest.mark.parametrize("tp,sp", [(1, False), (4, False), (4, True), (8, True)])
def test_terms_reproduce_korthikanti(tp, sp):
    model = _gpt()
    layout = Layout(tp=tp, sequence_parallel=sp, microbatch_size=2)
    terms = layer_activation_terms(model, layout, 2048, assumptions=EAGER)
    assert sum(terms.values()) == pytest.approx(
        korthikanti_layer_bytes(2048, 2, 12288, 96, t=tp, sp=sp))
    sel = layer_activation_bytes(model, layout.with_(recompute="selective"), 2048,
                                 assumptions=EAGER)
    assert sel == pytest.approx(korthikanti_layer_bytes(2048, 2, 12288, 96, t=tp, sp=sp,
                                                        recompute="selective"))


def test_flash_attention_keeps_only_logsumexp():
    model = _gpt()
    flash = layer_activation_terms(model, Layout(), 2048)
    assert flash["attention_scores"] == 4 * 96 * 2048  # one fp32 per head and query
    assert sum(flash.values()) == pytest.approx(34 * 2048 * 12288 + 4 * 96 * 2048)


def test_llama_terms_without_dropout():
    model = resolve_model("llama3-8b")  # GQA, SwiGLU, no dropout
    s, h, f, kv = 8192, 4096, 14336, 8 * 128
    terms = layer_activation_terms(model, Layout(), s)
    assert terms["dropout_masks"] == 0
    assert terms["attention_qkv"] == 2 * s * (h + 2 * kv)
    assert terms["mlp_hidden"] == 3 * 2 * s * f
    eager = layer_activation_terms(model, Layout(), s, assumptions=Assumptions(
        attention_kernel="eager", swiglu_saved_tensors=4, norm_saved_tensors=2))
    assert eager["attention_scores"] == 2 * 32 * s * s
    assert eager["mlp_hidden"] == 4 * 2 * s * f
    assert eager["norm_inputs"] == 2 * terms["norm_inputs"]


def test_context_parallel_halves_activations():
    model = resolve_model("llama3-8b")
    one = sum(layer_activation_terms(model, Layout(), 8192, assumptions=EAGER).values())
    two = sum(layer_activation_terms(model, Layout(cp=2), 8192, assumptions=EAGER).values())
    assert two == pytest.approx(one / 2)


def test_inflight_microbatches_per_schedule():
    assert inflight_chunks(Layout(pp=4), 0, 16) == 4
    assert inflight_chunks(Layout(pp=4), 3, 16) == 1
    assert inflight_chunks(Layout(pp=4), 0, 2) == 2
    assert inflight_chunks(Layout(pp=4, schedule="gpipe"), 0, 16) == 16
    # Interleaved, stage 0: pp*v + pp - 1 chunks = pp * (1 + (pp-1)/(pp v)) stages' worth.
    lay = Layout(pp=4, virtual_stages=2, schedule="interleaved-1f1b")
    assert inflight_chunks(lay, 0, 16) == 11
    assert inflight_chunks(lay, 0, 16) / 2 == pytest.approx(4 * (1 + 3 / 8))


def test_zero_bubble_peak_walks_the_schedule():
    """A microbatch costs `whole` from F to I and `deferred` from I to W. Stage 0 runs
    each W right after its I: 1F1B's p running microbatches. The last stage defers W by
    p - 1 microbatches: one running and three waiting."""
    assert zero_bubble_peak(4, 8, 0, whole=10.0, deferred=3.0) == 40.0
    assert zero_bubble_peak(4, 8, 3, whole=10.0, deferred=3.0) == 10.0 + 3 * 3.0
    assert zero_bubble_peak(4, 2, 3, whole=10.0, deferred=3.0) == 13.0  # few microbatches
    # Waiting microbatches can cost more than running ones: the stage before the last
    # (most of them, short of the last) is a peak candidate too.
    assert zero_bubble_peak(4, 8, 2, whole=10.0, deferred=12.0) > zero_bubble_peak(
        4, 8, 0, whole=10.0, deferred=12.0)
    assert peak_stages(8, "zb-h1") == [0, 1, 6, 7] and peak_stages(8) == [0, 1, 7]


def _walked_peak(p: int, m: int, stage: int, whole: float, deferred: float) -> float:
    """The ZB-H1 peak by walking the real action list, sampled after every F and I."""
    running = waiting = 0
    peak = 0.0
    for action in zb_h1_order(p, m, stage):
        if action.kind is Kind.F:
            running += 1
        elif action.kind is Kind.I:
            running, waiting = running - 1, waiting + 1
        else:
            waiting -= 1
        peak = max(peak, running * whole + waiting * deferred)
    return peak


@pytest.mark.parametrize("deferred", [0.0, 3.0, 10.0, 12.5])
def test_zero_bubble_peak_closed_form_matches_the_schedule(deferred):
    for p in range(1, 9):
        for m in range(1, 20):
            for stage in range(p):
                got = zero_bubble_peak(p, m, stage, 10.0, deferred)
                assert got == _walked_peak(p, m, stage, 10.0, deferred), (p, m, stage)


def test_activation_bytes_full_recompute_and_precision():
    model = resolve_model("llama3-8b")
    lay = Layout(pp=1, recompute="full")
    per_input = 2 * 8192 * 4096
    total = activation_bytes(model, lay, 8192, 1)
    working = sum(layer_activation_terms(model, lay, 8192).values())
    logits = 10 * 8192 * 128256
    # The peak is the larger of the forward's end (inputs, logits, the head's input) and
    # the last layer's rerun, which comes after the loss has released the logits (its
    # fused norm saves the very input the layer kept, counted once).
    assert total == pytest.approx(max(32 * per_input + logits + per_input,
                                      32 * per_input + working - per_input))
    short = Layout(pp=1, recompute="full", recompute_layers=8)
    none = sum(layer_activation_terms(model, Layout(), 8192).values())
    assert activation_bytes(model, short, 8192, 1) == pytest.approx(max(
        8 * per_input + 24 * none + logits + per_input,
        8 * per_input + working - per_input))
    fp32 = layer_activation_bytes(model, Layout(), 1024, precision=Precision.fp32())
    assert fp32 == pytest.approx(2 * layer_activation_bytes(model, Layout(), 1024), rel=1e-3)


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors created inside the region that are alive at once
    (storages counted once, released when their last tensor dies)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if key not in self.seen:
                    self.seen.add(key)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._release, key, nbytes)
        return out

    def _release(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("fp32", [False, True])
def test_loss_peak_is_saved_logits_plus_transients(tp, fp32):
    """The planner's loss side (the saved fp32 softmax + `loss_transients`) equals the
    peak of live tensors while partita's loss runs forward and backward: on the whole
    vocabulary at tp = 1, on one rank's half at tp = 2 (a group of one)."""
    from partita.comm import CommCounter, GroupComm
    from partita.loss import cross_entropy
    from partita.planner.memory import logits_bytes, loss_transient_bytes

    tokens, vocab, dim = 1024, 4096, 4  # dim small: the head's own gradients are noise
    dtype = torch.float32 if fp32 else torch.bfloat16
    local = vocab // tp
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, dim, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(local, dim, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, local, (1, tokens), generator=gen)
    group = GroupComm(None, [0], 0, "tensor", CommCounter())
    meter = _LiveBytes()
    with meter:
        logits = F.linear(h, w)  # the head's output, dropped once the loss has it
        loss = cross_entropy(logits, targets, None if tp == 1 else group, 0, local)
        del logits
        loss.backward()
    model = PlanModel("loss", ModelConfig(vocab_size=vocab, dim=dim, n_layers=1, n_heads=1))
    layout = Layout(tp=tp)
    precision = Precision.fp32() if fp32 else Precision()
    cpu = Assumptions.measured_cpu()
    predicted = (logits_bytes(model, layout, tokens, cpu)
                 + loss_transient_bytes(model, layout, tokens, precision, cpu))
    assert meter.peak == pytest.approx(predicted, rel=0.01)
    assert loss_transient_bytes(model, layout, tokens, precision, Assumptions()) == 0.0


def test_context_parallel_activations_fall_as_one_over_c_and_kv_buffers_are_counted():
    """Per rank, cp = c keeps s/c tokens' activations (scores replaced by a log-sum-exp
    in partita's kernels: so exactly 1/c of a cp = 1 run that also keeps none); the
    ring holds 2 K + 4 K_g of key/value buffers (the pair held and the one arriving; the
    own pair's gradients, the contribution being computed, one leaving, one arriving),
    the all-gather kind 2c (K + K_g)."""
    from partita.planner.context_parallel import buffer_bytes, kv_shard_bytes
    from partita.planner.memory import comm_buffer_bytes

    cfg = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=4096)
    model, a, prec = PlanModel("t", cfg), Assumptions.measured_cpu(), Precision.fp32()
    one = layer_activation_bytes(model, Layout(), 4096, prec, a)
    for c in (2, 4, 8):
        got = layer_activation_bytes(model, Layout(cp=c), 4096, prec, a)
        assert got == pytest.approx(one / c, rel=1e-9)
        k = kv_shard_bytes(model, Layout(cp=c), 4096, prec)
        assert k == 2 * 4096 / c * 2 * 16 * 4  # K and V, 2 kv heads of 16, fp32
        ring = comm_buffer_bytes(model, Layout(cp=c), 4096, prec, 0, a)
        assert ring["context_parallel_kv"] == 6 * k
        gather = buffer_bytes(model, Layout(cp=c, cp_kind="allgather"), 4096, prec, a)
        assert gather == 2 * c * 2 * k
    assert comm_buffer_bytes(model, Layout(), 4096, prec, 0, a)["context_parallel_kv"] == 0
    # Selective recompute leaves the cp core (no scores) alone: nothing dropped, nothing
    # rerun; full keeps each layer's input, 1/c of it too.
    for c in (2, 4):
        plain = activation_bytes(model, Layout(cp=c), 4096, 1, 0, prec, a)
        sel = activation_bytes(model, Layout(cp=c, recompute="selective"), 4096, 1, 0, prec, a)
        assert sel == plain
        full = layer_activation_bytes(model, Layout(cp=c, recompute="full"), 4096, prec, a)
        assert full == pytest.approx(layer_activation_bytes(
            model, Layout(recompute="full"), 4096, prec, a) / c, rel=1e-12)



@pytest.mark.parametrize("ep,stage", [(1, 3), (2, 3), (4, 3), (1, 2), (2, 1)])
def test_zero_flat_buffers_match_the_engine(ep, stage):
    """ZeRO's padded flat buffers as the planner counts them and as partita's engine
    builds them (`zero.units`, `zero.families`; on the meta device): dense and MoE blocks
    mixed, experts a family of their own under ep > 1, sizes that do not align."""
    from types import SimpleNamespace

    from partita.experts.apply import apply_expert_parallel
    from partita.models import build_model
    from partita.sharding import reduce_group
    from partita.zero.families import by_family, split_families
    from partita.zero.flat import FlatBuffer
    from partita.zero.units import buckets_by_size, gather_units, partition, resolve_blocks

    cfg = ModelConfig(dim=40, n_layers=5, n_heads=4, n_kv_heads=2, vocab_size=100,
                      ffn_dim=70, n_experts=4, top_k=2, moe_every=2, expert_ffn_dim=50)
    layout, prec = Layout(dp=8, ep=ep, zero_stage=stage), Precision()
    model = build_model(cfg, "meta")
    apply_expert_parallel(model, model.plan(), SimpleNamespace(size=ep, index=0))
    groups = {"zero_shard": 8, "expert_grad_reduce": 8 // ep}

    def padded(params) -> int:
        return FlatBuffer(params, groups[reduce_group(params[0][1])], 0, torch.bfloat16,
                          torch.device("meta")).padded

    # Stage 3 gather units of about two blocks (a dense block is bigger than an MoE
    # block's dense part); stages 0-2 one gradient bucket.
    block = sum(p.numel() for p in model.blocks["0"].parameters()) * prec.param
    a = dataclasses.replace(Assumptions.measured_cpu(),
                            zero_bucket_bytes=2.5 * block if stage == 3 else 1e9)
    engine = {"dense": 0, "expert": 0}
    if stage == 3:
        root, per_block = partition(model, resolve_blocks(model, None))
        dense, apart = split_families(per_block)
        units = [padded([p for i in u for p in dense[i]])
                 for u in gather_units(dense, a.zero_bucket_bytes, prec.param)]
        experts = [padded(ps) for ps in apart if ps]
        got = zero3_buffers(PlanModel("t", cfg), layout, prec, 0, a)
        assert (got["units"], got["experts"], got["root"]) == (units, experts, padded(root))
        # Blocks merged into units (with ep = 1 an MoE block's experts fill one alone).
        assert 1 < len(units) < (6 if ep == 1 else 4) and len(experts) == 2 * (ep > 1)
        engine = {"dense": sum(units) + padded(root), "expert": sum(experts)}
    else:
        # On CPU the engine cuts buckets without the small first and last ones.
        for b in by_family(buckets_by_size(model, a.zero_bucket_bytes, prec.param,
                                           overlap_caps=False)):
            engine["dense" if reduce_group(b[0][1]) == "zero_shard" else "expert"] += padded(b)
    assert padded_params(PlanModel("t", cfg), layout, prec, 0, a) == engine
