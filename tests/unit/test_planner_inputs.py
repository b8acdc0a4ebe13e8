"""What the planner reads: model shapes from the command line, pinned search choices,
overlap options and the distributed-optimizer alias, and the papers' FLOP counts."""

import pytest

from partita.config import Config
from partita.errors import PartitaError
from partita.layout import Layout, parse_layout
from partita.layout_rules import UNAVAILABLE, find_problems
from partita.planner import Cluster, get_gpu, make_request, resolve_model, search, step_time
from partita.planner.model_shape import parse_model_shape
from partita.planner.report import describe_request
from partita.planner.search import SearchSpace


def test_model_shape_reads_every_field_and_refuses_gaps():
    m = parse_model_shape("layers=96,hidden=12288,heads=96,vocab=51200,seq=2048,flavour=gpt2")
    c = m.config
    assert (c.n_layers, c.dim, c.n_heads, c.vocab_size, c.max_seq_len) == (96, 12288, 96,
                                                                          51200, 2048)
    assert c.flavour == "gpt2" and c.tie_embeddings
    assert m.total_params() == pytest.approx(174.6e9, rel=0.01)  # GPT-3 175B
    llama = parse_model_shape("layers=80 hidden=8192 heads=64 kv_heads=8 ffn=28672 "
                              "vocab=128256 seq=8192")
    assert llama.total_params() == pytest.approx(resolve_model("llama3-70b").total_params())
    moe = parse_model_shape("layers=4,hidden=512,heads=8,vocab=1000,seq=256,num_experts=8,top_k=2")
    assert moe.is_moe and moe.moe.top_k == 2
    header = describe_request(make_request(moe, 8))
    assert "8 experts of ffn " in header and "top-2" in header
    with pytest.raises(PartitaError, match="give top_k with num_experts"):
        parse_model_shape("layers=4,hidden=512,heads=8,vocab=1000,seq=256,num_experts=8")
    with pytest.raises(PartitaError, match="give seq"):
        parse_model_shape("layers=4,hidden=512,heads=8,vocab=1000")
    with pytest.raises(PartitaError, match="Did you mean 'layers'"):
        parse_model_shape("layer=4,hidden=512,heads=8,vocab=1000,seq=256")
    with pytest.raises(PartitaError, match="not a number"):
        parse_model_shape("layers=four,hidden=512,heads=8,vocab=1000,seq=256")


def test_fixed_choices_narrow_the_search():
    req = make_request("llama3-8b", 64, "H100", seq_len=4096, global_batch=256)
    free = search(req)
    space = SearchSpace(fixed=(("tp", 2), ("pp", 4), ("zero_stage", 1)))
    pinned = search(req, space)
    assert pinned.ranked and pinned.searched < free.searched
    for ev in pinned.ranked + [e for v in pinned.examples.values() for e in v]:
        assert (ev.layout.tp, ev.layout.pp, ev.layout.zero_stage) == (2, 4, 1)
    # Pinning sequence parallelism off is honoured too.
    off = search(req, SearchSpace(fixed=(("tp", 2), ("sequence_parallel", False))))
    assert off.ranked and not any(e.layout.sequence_parallel for e in off.ranked)


def test_overlap_options_and_distributed_optimizer_alias():
    lay = parse_layout("dp=4 tp=2 zero_stage=distributed-optimizer tp_comm_overlap=true "
                       "overlap_grad_reduce=0")
    assert lay.zero_stage == 1 and lay.tp_comm_overlap is True
    assert lay.overlap_grad_reduce is False and lay.overlap_param_gather is True
    with pytest.raises(PartitaError, match="true or false"):
        Layout(tp_comm_overlap=2)
    # partita train does not chunk TP collectives: the layout says so, by kind.
    model = resolve_model("tiny").config
    kinds = [p.kind for p in find_problems(lay, model, 8, seq_len=128, global_batch=16)]
    assert kinds == [UNAVAILABLE]
    cfg = Config()
    cfg.parallel.tp, cfg.parallel.overlap_param_gather = 2, False
    assert cfg.layout(2).overlap_param_gather is False


def test_papers_metrics_count_recompute():
    model, gpu = resolve_model("gpt3-175b"), get_gpu("A100-80GB")
    cluster = Cluster(gpu, 64, 8)
    base = Layout(tp=8, pp=8, sequence_parallel=True)
    c, seq = model.config, 2048
    for recompute, extra in (("none", 0.0), ("selective", 4 * c.dim * seq * c.n_layers),
                             ("full", None)):
        t = step_time(model, base.with_(recompute=recompute), cluster, seq, 64)
        model_flops = model.flops_per_token(seq) * 64 * seq
        assert t["model_flops_per_gpu"] == pytest.approx(model_flops / t["step_s"] / 64)
        hw = t["hardware_flops_per_gpu"] * t["step_s"] * 64 / (64 * seq)
        if extra is None:  # Megatron's 96 B s l h^2 (1 + s/6h + V/16lh) per sequence
            h, l_, v = c.dim, c.n_layers, c.padded_vocab_size  # the GEMM's rows
            megatron = 96 * seq * l_ * h * h * (1 + seq / (6 * h) + v / (16 * l_ * h)) / seq
            assert hw == pytest.approx(megatron, rel=0.01)
        else:
            assert hw == pytest.approx(model.flops_per_token(seq) + extra)


def test_pinned_unavailable_options_are_modelled_not_ranked():
    """A run partita cannot train yet (tensor-parallel communication overlap) is still
    predicted: such layouts are listed apart, fastest first, never ranked as trainable."""
    req = make_request("llama3-70b", 64, "H100", seq_len=8192, global_batch=64)
    result = search(req, SearchSpace(fixed=(("tp", 8), ("tp_comm_overlap", True))))
    assert not result.ranked and result.modelled
    steps = [e.time["step_s"] for e in result.modelled]
    assert steps == sorted(steps)
    assert all(e.layout.tp_comm_overlap and e.layout.tp == 8 for e in result.modelled)
    assert all(k == UNAVAILABLE for e in result.modelled for k, _ in e.reasons)
    # cp runs with every recompute mode: ranked, none of it merely modelled. Selective
    # reruns nothing under cp, so it never ranks above none.
    cp = search(req, SearchSpace(context_parallel=True, fixed=(("cp", 2), ("tp", 4))))
    assert cp.ranked and not cp.modelled and all(e.layout.cp == 2 for e in cp.ranked)
    assert {e.layout.recompute for e in cp.ranked} == {"none", "selective", "full"}
    assert cp.best.layout.recompute != "selective"
