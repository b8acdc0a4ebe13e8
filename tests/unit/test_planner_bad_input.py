"""`partita plan` and `partita schedule` refuse bad input with a clear message, before
any work: degrees, files, picture names, shapes beyond reason, names given twice."""

import time

import pytest

from partita.cli import main
from partita.errors import PartitaError
from partita.layout import divisors, parse_layout
from partita.planner.model_shape import parse_model_shape, resolve_model

SHAPE = "layers=4,hidden=64,heads=4,vocab=256,seq=64"


def _refused(capsys, *argv: str) -> str:
    """The error of a command that must exit 2 having printed nothing on stdout."""
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    return captured.err


@pytest.mark.parametrize("degree", ["tp", "pp", "cp", "dp"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_degree_below_one_is_named_as_given(capsys, degree, value):
    err = _refused(capsys, "plan", "--model", "llama3-8b", "--gpus", "8",
                   "--layout", f"{degree}={value}")
    assert f"{degree}={value} is invalid: every degree is a positive integer" in err
    assert "parallel.dp" not in err  # a field the user did not give


def test_names_given_twice_are_refused():
    for text, says in (("tp=2 tp=4", "gives tp twice ('tp=2' and 'tp=4')"),
                       ("mb=2 microbatch_size=4", "gives microbatch_size twice")):
        with pytest.warns(FutureWarning) if "mb=" in text else _no_warning():
            with pytest.raises(PartitaError, match=f"(?s).*{_escape(says)}"):
                parse_layout(text, 8)
    for extra, says in (("layers=8", "n_layers twice ('layers=4' and 'layers=8')"),
                        ("n_layers=8", "n_layers twice"), ("dim=128", "dim twice"),
                        ("num_experts=8,top_k=2,n_experts=4", "num_experts twice")):
        with pytest.raises(PartitaError, match=_escape(says)):
            parse_model_shape(f"{SHAPE},{extra}")


def test_a_pin_given_twice_is_refused(capsys):
    err = _refused(capsys, "plan", "--model", "llama3-8b", "--gpus", "8", "--fix", "tp=2,tp=4")
    assert "tp is given twice" in err


def test_expert_names_are_one_setting_with_its_top_k(tmp_path):
    # n_experts is num_experts: both need top_k, and both plan the same model.
    for name in ("n_experts", "num_experts"):
        with pytest.raises(PartitaError, match="give top_k with num_experts"):
            parse_model_shape(f"{SHAPE},{name}=8")
    a = parse_model_shape(f"{SHAPE},n_experts=8,top_k=2")
    b = parse_model_shape(f"{SHAPE},num_experts=8,top_k=2")
    assert (a.moe, a.total_params()) == (b.moe, b.total_params())
    assert a.moe.num_experts == 8 and a.moe.top_k == 2
    shape = ("[model]\nn_layers = 4\ndim = 64\nn_heads = 4\nvocab_size = 256\n"
             "max_seq_len = 64\n")
    for tables, says in (("[moe]\nnum_experts = 8\n", "[moe] num_experts = 8 without top_k"),
                         ("", "[model] n_experts = 8 without top_k")):
        path = tmp_path / "moe.toml"
        text = shape + ("n_experts = 8\n" if not tables else "") + tables
        path.write_text(text)
        with pytest.raises(PartitaError, match=_escape(says)):
            resolve_model(str(path))
    path.write_text(shape + "n_experts = 8\n[moe]\nnum_experts = 4\ntop_k = 2\n")
    with pytest.raises(PartitaError, match="gives the experts twice"):
        resolve_model(str(path))


@pytest.mark.parametrize("option", ["--model", "--hardware"])
def test_a_folder_or_binary_file_is_refused(tmp_path, capsys, option):
    folder = tmp_path / "dir.toml"
    folder.mkdir()
    binary = tmp_path / "bytes.toml"
    binary.write_bytes(b"\xff\xfe[model]\n")
    for path, says in ((folder, "is a folder"), (binary, "is not UTF-8 text")):
        argv = (["--model", str(path)] if option == "--model"
                else ["--model", "llama3-8b", "--hardware", str(path)])
        assert says in _refused(capsys, "plan", *argv, "--gpus", "8")


@pytest.mark.parametrize("command", [
    ["schedule", "1f1b", "-p", "2", "-m", "2"],
    ["plan", "--model", "llama3-8b", "--gpus", "8", "--top", "1"],
])
def test_a_picture_name_is_checked_before_any_work(tmp_path, capsys, command):
    for png, says in ((str(tmp_path / "out.txt"), "the file name has '.txt'"),
                      (str(tmp_path / "out.pdfx"), "'.pdfx'"),
                      (str(tmp_path / "out"), "no extension"),
                      ("", "--png is empty"),
                      ("/proc/partita-test.png", "cannot be written")):
        assert says in _refused(capsys, *command, "--png", png)
    assert not list(tmp_path.iterdir())  # the write probe leaves no file behind
    png = tmp_path / "out.svg"
    assert main([*command, "--png", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out and png.stat().st_size > 0


def test_a_plan_where_nothing_fits_draws_the_closest(tmp_path, capsys):
    png = tmp_path / "closest.png"
    assert main(["plan", "--model", "llama3-405b", "--gpus", "8", "--png", str(png)]) == 1
    assert f"wrote {png} (the closest layouts, none fits)" in capsys.readouterr().out
    assert png.stat().st_size > 0


def test_shapes_beyond_reason_are_refused_at_once():
    for extra, limit in (("seq=999999999", "4,194,304"), ("hidden=999999999", "1,048,576"),
                         ("layers=100000000", "2,048"), ("vocab=999999999", "16,777,216"),
                         ("heads=999999999", "65,536")):
        name = extra.partition("=")[0]
        kept = ",".join(i for i in SHAPE.split(",") if not i.startswith(name + "="))
        with pytest.raises(PartitaError, match=f"out of range for the planner: use at most "
                                               f"{limit}"):
            parse_model_shape(f"{kept},{extra}")
    start = time.perf_counter()
    big = divisors(999_999_999)
    assert time.perf_counter() - start < 0.5  # square root, not n, trial divisions
    assert big[:5] == [1, 3, 9, 27, 37] and big[-1] == 999_999_999
    assert all(999_999_999 % d == 0 for d in big)
    for n in range(1, 600):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_a_cpu_plan_shows_its_batch_in_tokens(capsys):
    from partita.planner.api import make_request
    from partita.planner.report import describe_request

    line = describe_request(make_request(parse_model_shape(SHAPE), 2, global_batch=16))
    assert "(1,024 tokens)" in line
    # The filled-in shape figures are on the first line too.
    assert "ffn 192" in line and "llama flavour" in line and "untied embeddings" in line


def _escape(text: str) -> str:
    import re

    return re.escape(text)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_schedule_too_large_to_draw_is_refused_at_once(capsys):
    start = time.perf_counter()
    err = _refused(capsys, "schedule", "zb-h1", "-p", "8192", "-m", "1")
    assert time.perf_counter() - start < 1.0  # refused, not simulated (111 s before)
    assert "more than the 1,048,576" in err and "at most 1,024" in err
    assert main(["schedule", "zb-h1", "-p", "1024", "-m", "1"]) == 0


def _step(gpu, precision="bf16", layout="dp=8", **request):
    from partita.planner.api import evaluate_layout

    return evaluate_layout("llama3-8b", 8, layout, gpu_type=gpu, precision=precision,
                           **request).time


def test_a_profile_runs_its_bases_gemm_fraction(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text('[gpu.my-h100]\nbase = "H100"\n[gpu.my-copy]\nbase = "my-h100"\n')
    h100 = _step("H100")["step_s"]
    for name in ("my-h100", "my-copy"):  # the default fraction (0.75) before
        assert _step(name, hardware_file=str(path))["step_s"] == pytest.approx(h100)


def test_fp32_runs_at_the_float32_peak():
    bf16, fp32 = _step("H100", "bf16"), _step("H100", "fp32")
    # 67 of 989 TFLOP/s: the GEMMs about 15x slower, not as fast as bf16.
    assert fp32["compute_s"] > 10 * bf16["compute_s"]
    assert fp32["mfu"] == pytest.approx(fp32["model_flops_per_gpu"] / 67e12)


def test_parameter_offload_costs_its_copies():
    base = "zero_stage=3 overlap_param_gather=0 offload="
    opt, params = (_step("H100", layout=base + o) for o in ("optimizer", "optimizer+params"))
    assert opt["stage_in_s"] == 0 and params["stage_in_s"] > 0
    assert params["step_s"] == pytest.approx(opt["step_s"] + params["stage_in_s"], rel=1e-3)


def test_the_default_batch_divides_over_data_parallel_degrees(capsys):
    from partita.planner.api import default_global_batch

    assert default_global_batch(8196) == 256 and default_global_batch(8192) == 512
    assert default_global_batch(1 << 22) == 1
    # 511 sequences before: no dp > 1 divided them.
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "8196",
                 "--layout", "dp=8 zero_stage=3 recompute=full"]) == 0
    assert "--global-batch 256 (the power of two" in capsys.readouterr().out


def test_json_names_the_figures_it_used(capsys):
    import json

    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--json", "--top", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["assumptions"]["gemm_peak_fraction"] == 0.68  # H100's, not 0.0
    assert data["keep_gathered"] == 0  # as the defaults line says, not null


def test_pins_the_loops_do_not_vary_are_kept():
    from partita.planner import plan
    from partita.planner.search import SearchSpace

    space = SearchSpace(recompute=("full",), fixed=(("recompute", "full"),
                                                     ("recompute_layers", 5)))
    result = plan("llama3-8b", 8, space)
    assert result.ranked and all(e.layout.recompute_layers == 5 for e in result.ranked)


def test_an_impossible_microbatch_pin_is_named(capsys):
    err = _refused(capsys, "plan", "--model", "llama3-8b", "--gpus", "8",
                   "--fix", "microbatch_size=100")
    assert "microbatch_size=100:" in err and "microbatch_size=1:" not in err
    assert "choose a microbatch_size that divides" in err and "train." not in err


def test_plan_errors_speak_plans_options(capsys):
    err = _refused(capsys, "plan", "--model", "llama3-8b", "--gpus", "8",
                   "--layout", "dp=2 tp=2")
    assert "--gpus 4" in err and "--layout dp=4" in err
    assert "--nproc" not in err and "parallel." not in err
    err = _refused(capsys, "plan", "--model", "llama3-8b", "--gpus", "8",
                   "--global-batch", "511", "--layout", "dp=8")
    assert "--global-batch 511 is not divisible" in err and "train." not in err
    # One rule, said once (the planner repeated the trainer's ep rule).
    err = _refused(capsys, "plan", "--model", "llama3-8b", "--gpus", "8", "--layout", "ep=2")
    assert "breaks 1 rule" in err and "ep=2 spreads experts" in err


def test_a_schedule_without_a_pipeline_is_named(capsys):
    err = _refused(capsys, "plan", "--model", "llama3-8b", "--gpus", "8",
                   "--fix", "schedule=gpipe,pp=1")
    assert "pp=1 has no pipeline" in err
    err = _refused(capsys, "plan", "--model", "llama3-8b", "--gpus", "8",
                   "--layout", "pp=1 schedule=zb-h1")
    assert "pp=1 has no pipeline" in err


def test_every_default_that_changes_the_answer_is_printed(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--layout", "tp=2 pp=2",
                 "--global-batch", "64"]) in (0, 1)
    defaults = capsys.readouterr().out.splitlines()[-1]
    assert "schedule=1f1b" in defaults and "virtual_stages=1" in defaults
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--fix", "cp=2",
                 "--top", "1"]) == 0
    assert "cp_kind=ring" in capsys.readouterr().out.splitlines()[-1]


def test_a_layout_that_fits_but_cannot_run_says_so(capsys):
    import json

    argv = ["plan", "--model", "llama3-8b", "--gpus", "8", "--layout", "tp=8 tp_comm_overlap=1"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "tp_comm_overlap=1" in out.split("Layout: ")[1].splitlines()[0]
    assert "Fits in memory (25.1 of 80 GB), but partita train cannot run it yet" in out
    assert main([*argv, "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)["evaluation"]
    assert ev["fits_in_memory"] and not ev["fits"]


def test_a_bad_base_names_its_file_and_table(tmp_path, capsys):
    for body, says in (('[gpu.x]\nbase = "V100"\n', "[gpu.x]: base = \"V100\" is no catalog"),
                       ('[gpu.x]\nbase = "x"\n', "names this table itself")):
        path = tmp_path / "hw.toml"
        path.write_text(body)
        err = _refused(capsys, "plan", "--model", "llama3-8b", "--gpus", "8",
                       "--hardware", str(path))
        assert f"hardware file '{path}'" in err and says in err


def test_a_closed_pipe_keeps_the_plans_status():
    import subprocess
    import sys

    cmd = (f"{sys.executable} -m partita.cli plan --model llama3-405b --gpus 8 | true "
           "; echo ${PIPESTATUS[0]}")  # true reads nothing: the first write breaks
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "1", done.stderr  # nothing fits: 1, as with | cat


def test_assumption_and_kept_unit_values_are_checked(capsys):
    err = _refused(capsys, "plan", "--model", "llama3-8b", "--gpus", "8",
                   "--set", "device_type=bogus")
    assert "device_type='bogus'" in err
    err = _refused(capsys, "plan", "--model", "llama3-8b", "--gpus", "8",
                   "--keep-gathered", "1000")
    assert "give at most 32" in err
    err = _refused(capsys, "plan", "--model", "llama3-8b", "--gpus", "8",
                   "--keep-gathered", "2", "--layout", "zero_stage=1")
    assert "applies to ZeRO-3" in err
