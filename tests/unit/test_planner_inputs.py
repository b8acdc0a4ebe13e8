"""What the planner reads: model shapes from the command line, pinned search choices,
overlap options and the distributed-optimizer alias, and the papers' FLOP counts."""

import re

import pytest

from partita.cli import main
from partita.config import Config
from partita.errors import PartitaError
from partita.layout import Layout, parse_layout
from partita.layout_rules import UNAVAILABLE, find_problems
from partita.planner import (
    Cluster,
    get_gpu,
    load_gpu_profiles,
    make_request,
    resolve_model,
    search,
    step_time,
)
from partita.planner.assumptions import Assumptions
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
    with pytest.raises(PartitaError, match="layers must be an integer"):
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


SHAPE = "layers=4,hidden=64,heads=4,vocab=256,seq=64"
bad_input = pytest.mark.fault_suite("planner input")


def _plan_error(capsys, *argv: str) -> str:
    """`partita plan ARGV` refused as bad input: exit 2, one `partita: error:` line and
    no traceback; the message."""
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("partita: error: ") and "Traceback" not in err, err
    return err


@bad_input
def test_an_empty_model_is_refused(capsys):
    assert "--model-shape is empty" in _plan_error(capsys, "--model-shape", "", "--gpus", "2")
    assert "--model is empty" in _plan_error(capsys, "--model", " ", "--gpus", "2")


@bad_input
def test_model_files_are_read_with_trains_types_and_ranges(tmp_path, capsys):
    cases = {'[model]\nname = "tiny"\nn_layers = "eight"\n':
             "[model] n_layers = 'eight': n_layers must be an integer (got text)",
             "model = 3\n": "'model' = 3 is an integer, not a [model] table",
             '[model]\nname = "tiny"\nn_heads = [4]\n': "n_heads must be an integer (got a list)",
             '[model]\nname = "tiny"\ntie_embeddings = "maybe"\n': "must be true or false",
             '[model]\nname = "tiny"\ndropout = 1.5\n': "dropout = 1.5 is out of range: use >= 0 and < 1",
             '[model]\nname = "tiny"\nffn_dim = 0\n': "ffn_dim = 0 is out of range: use >= 1",
             '[model]\nname = "tiny"\n[moe]\nnum_experts = "x"\n':
             "[moe] num_experts = 'x': num_experts must be an integer",
             '[model]\nname = "tiny"\nmoe = 2\n': None}  # an unknown key: from_dict's message
    for i, (text, says) in enumerate(cases.items()):
        path = tmp_path / f"m{i}.toml"
        path.write_text(text)
        err = _plan_error(capsys, "--model", str(path), "--gpus", "2")
        assert f"model config '{path}'" in err or says is None, err
        assert says is None or says in err, err
    # What the checks let through still plans: whole floats and quoted numbers, as train.
    good = tmp_path / "good.toml"
    good.write_text('[model]\nname = "tiny"\nn_layers = 2.0\ndim = "64"\n')
    assert resolve_model(str(good)).config.n_layers == 2


@bad_input
def test_model_shape_reads_each_key_as_its_type():
    m = parse_model_shape(f"{SHAPE},num_experts=4,top_k=2,capacity_factor=1.25,"
                          "rope_factor=8.0,tie=no,flavour=LLAMA")
    c = m.config
    assert (c.capacity_factor, c.rope_factor, c.tie_embeddings) == (1.25, 8.0, False)
    assert parse_model_shape(f"{SHAPE},tie=yes").config.tie_embeddings
    for extra, says in (("tie=maybe", "tie must be true or false"),
                        ("layers=4.5", "layers must be an integer"),
                        ("dropout=1.5", "dropout=1.5 is out of range: use >= 0 and < 1"),
                        ("ffn=0", "ffn=0 is out of range: use >= 1"),
                        ("kv_heads=-2", "kv_heads=-2 is out of range")):
        name = extra.partition("=")[0]  # each setting given once: replace SHAPE's own
        kept = ",".join(item for item in SHAPE.split(",") if not item.startswith(name + "="))
        with pytest.raises(PartitaError, match=re.escape(says)):
            parse_model_shape(f"{kept},{extra}")


@bad_input
def test_hardware_profiles_need_finite_positive_figures(tmp_path, capsys):
    cases = {'peak_flops = "fast"': "peak_flops = 'fast' is not a valid figure",
             "memory_bandwidth = 0": "memory_bandwidth = 0 is not a valid figure; give a "
                                     "finite number > 0 in bytes/s",
             "peak_flops = -1": "peak_flops = -1",
             "inter_node_bandwidth = inf": "inter_node_bandwidth = inf",
             "peak_flops = true": "peak_flops = True",
             "intra_node_latency = -1e-6": "give a finite number >= 0 in s",
             "gpus_per_node = 2.5": "gpus_per_node = 2.5 must be a whole number >= 1",
             'name = "y"': "a profile is named by its table"}
    for i, (line, says) in enumerate(cases.items()):
        path = tmp_path / f"hw{i}.toml"
        path.write_text(f'[gpu.x]\nbase = "H100"\n{line}\n')
        err = _plan_error(capsys, "--model", "tiny", "--gpus", "8", "--hardware", str(path),
                          "--gpu-type", "x")
        assert f"hardware file '{path}', [gpu.x]: " in err and says in err, err
    for text, says in (("[gpu]\nx = 3\n", "'x' must be a table"),
                       ("[gpu.x]\nbase = 3\n", "base = 3 is not a GPU name")):
        path = tmp_path / "other.toml"
        path.write_text(text)
        with pytest.raises(PartitaError, match=re.escape(says)):
            load_gpu_profiles(path)
    # Zero where zero means "not modelled" stays valid.
    path = tmp_path / "ok.toml"
    path.write_text('[gpu.x]\nbase = "H100"\nintra_node_latency = 0\nbf16_flops = 0\n')
    assert load_gpu_profiles(path)["x"].intra_node_latency == 0


@bad_input
def test_every_assumption_has_a_range_and_set_parses_strictly(capsys):
    from dataclasses import fields

    from partita.planner.assumptions import RANGES

    numeric = {f.name for f in fields(Assumptions) if f.type in ("int", "float")}
    assert numeric == set(RANGES)  # a new assumption must say what is valid
    for preset in (Assumptions(), Assumptions.measured_cpu(), Assumptions.partita_on_gpu()):
        assert preset.override({}) == preset  # every preset is within its ranges
    cases = {"memory_efficiency=0": "memory_efficiency=0.0 is out of range: use > 0 and <= 1",
             "kernel_overhead_s=-1": "kernel_overhead_s=-1.0 is out of range: use >= 0",
             "misaligned_gemm_fraction=0": "use > 0 and <= 1",
             "disk_bandwidth=0": "disk_bandwidth=0.0 is out of range: use > 0",
             "fragmentation=nan": "fragmentation=nan is out of range",
             "tp_overlap=1.5": "tp_overlap=1.5 is out of range: use >= 0 and <= 1",
             "compile_gain=maybe": "compile_gain='maybe' is not true or false",
             "gemm_tile=1.5": "gemm_tile='1.5' is not an integer",
             "gemm_tile=big": "gemm_tile='big' is not a number"}
    for setting, says in cases.items():
        err = _plan_error(capsys, "--model", "tiny", "--gpus", "8", "--set", setting)
        assert says in err, err
    base = Assumptions()
    assert base.override({"compile_gain": "no"}).compile_gain is False
    assert base.override({"compile_gain": "1"}).compile_gain is True
    assert base.override({"gemm_tile": "64"}).gemm_tile == 64
    assert base.override({"gemm_tile": "1e2"}).gemm_tile == 100
    with pytest.raises(PartitaError, match="zero3_kept_units=True is not an integer"):
        Assumptions(zero3_kept_units=True)


@bad_input
def test_pins_and_layouts_that_break_a_rule_are_bad_input(capsys):
    """Every layout rejected by a rule (not memory) is bad input, exit 2, naming the rule."""
    err = _plan_error(capsys, "--model", "llama3-8b", "--gpus", "8", "--fix",
                      "zero_stage=3,pp=2")
    assert "--fix zero_stage=3,pp=2 leaves no layout partita can train on 8 GPUs" in err
    assert "(constraint: 225;" in err and "ZeRO stage 3 with pipeline parallelism" in err
    err = _plan_error(capsys, "--model-shape", "layers=4,hidden=64,heads=4,vocab=256,seq=63",
                      "--gpus", "4", "--fix", "cp=2")
    assert "The most common (divisibility)" in err and "not divisible by 2*cp=4" in err
    err = _plan_error(capsys, "--model-shape", "layers=4,hidden=384,heads=6,vocab=256,seq=128",
                      "--gpus", "4", "--layout", "dp=1 tp=4 pp=1", "--json")
    assert "partita cannot train this layout on 4 GPUs" in err
    assert "model.n_heads=6 is not divisible by tp=4" in err
    # No pins, every layout breaking a rule: the request is what must change.
    err = _plan_error(capsys, "--model-shape", "layers=1,hidden=64,heads=1,vocab=256,seq=63",
                      "--gpus", "4", "--global-batch", "1")
    assert "this request leaves no layout" in err and "none was rejected for memory" in err
    # A layout that is valid but does not fit is still an answer: exit 1.
    assert main(["plan", "--model", "llama3-70b", "--gpus", "8", "--layout", "dp=8"]) == 1
    assert "does not fit" in capsys.readouterr().out


@bad_input
def test_advice_keeps_the_pins(capsys):
    """When pins were given, the suggested request changes keep them."""
    assert main(["plan", "--model", "llama3-70b", "--gpus", "8", "--fix", "cp=2",
                 "--global-batch", "64"]) == 1
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines()
             if line.startswith(("Smallest change", "  or "))]
    assert lines
    for line in lines:
        if "drop --fix" not in line:
            assert " cp=2 " in line and ("keeping --fix cp=2" in line or "--fix cp=2," in line)


def test_a_sequence_beyond_gpt2s_positions_is_planned_as_train_builds_it():
    """partita train grows GPT-2's learned positions to data.seq_len (Config.model_config);
    the planner plans that model instead of refusing the sequence."""
    from partita.planner.api import make_request

    base = make_request("gpt2-124m", 8, "H100", seq_len=1024)
    longer = make_request("gpt2-124m", 8, "H100", seq_len=4096)
    assert longer.model.config.max_seq_len == 4096
    grown = longer.model.total_params() - base.model.total_params()
    assert grown == (4096 - 1024) * 768  # the new position rows


@bad_input
def test_a_layout_with_search_options_and_a_hardware_file_without_a_gpu(capsys, tmp_path):
    """--fix or --all-options beside --layout was silently ignored; --hardware without
    --gpu-type planned on the H100. Now: refused, and the file's one GPU is taken (a file
    of several must name it)."""
    err = _plan_error(capsys, "--model", "llama3-8b", "--gpus", "8", "--layout", "dp=8",
                      "--fix", "tp=2")
    assert "--layout evaluates one layout and --fix shapes a search" in err
    one, two = tmp_path / "one.toml", tmp_path / "two.toml"
    one.write_text('[gpu.mygpu]\nbase = "H100"\ninter_node_bandwidth = 25e9\n')
    two.write_text('[gpu.a]\nbase = "H100"\n[gpu.b]\nbase = "A100"\n')
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--hardware", str(one)]) == 0
    out = capsys.readouterr().out
    assert "on 8 x mygpu" in out and "--gpu-type mygpu (the one in --hardware)" in out
    err = _plan_error(capsys, "--model", "llama3-8b", "--gpus", "8", "--hardware", str(two))
    assert "describes 2 GPUs (a, b): name the one to plan for with --gpu-type" in err
