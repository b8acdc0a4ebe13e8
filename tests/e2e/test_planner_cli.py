"""`partita plan` through `partita.cli.main`, hardware profiles and catalogs."""

import json

import pytest

from partita.cli import main
from partita.errors import PartitaError
from partita.planner import GPUS, get_gpu, load_gpu_profiles
from partita.planner.cpu_profile import measure_local_cpu


def test_ranked_table(capsys):
    assert main(["plan", "--model", "llama3-70b", "--gpus", "64", "--top", "3"]) == 0
    out = capsys.readouterr().out
    for word in ("params", "grads", "master", "optim", "activ", "buffers", "frag",
                 "tokens/s", "MFU", "bubble", "Rejected:", "does not fit", "constraint"):
        assert word in out
    assert "searched " in out.splitlines()[-2] and " layouts in " in out
    assert out.splitlines()[-1].startswith("Defaults filled in: ")


def test_json_output(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--json", "--top", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["ranked"]) == 2 and data["searched"] > 0
    first = data["ranked"][0]
    assert first["fits"] and first["memory_bytes"]["total"] <= 80e9
    assert set(first["time"]) >= {"step_s", "tokens_per_s", "mfu", "bubble_fraction"}


def test_layout_evaluation(capsys):
    assert main(["plan", "--model", "llama3-70b", "--gpus", "64",
                 "--layout", "tp=8 pp=4 zero_stage=1 microbatch_size=1"]) == 0
    out = capsys.readouterr().out
    assert "dp=2 tp=8 pp=4" in out and "Fits." in out and "master_weights" in out
    # A layout that does not fit: exit 1, the reason and the smallest change.
    assert main(["plan", "--model", "llama3-70b", "--gpus", "64", "--layout", "dp=64"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "Smallest change that would fit:" in out


def test_layout_json(capsys):
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--gpu-type", "A100-40GB",
                 "--layout", "dp=2 zero_stage=2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["evaluation"]["fits"] and data["evaluation"]["degrees"]["zero_stage"] == 2


def test_nothing_fits_says_what_would(capsys):
    assert main(["plan", "--model", "llama3-405b", "--gpus", "8", "--gpu-type", "A100-40GB",
                 "--global-batch", "64", "--seq-len", "2048"]) == 1
    out = capsys.readouterr().out
    assert "No layout fits." in out and "--gpus" in out


def test_unknown_names_list_known(capsys):
    assert main(["plan", "--model", "llama-8b", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "llama3-8b" in err and "gpt3-175b" in err
    assert main(["plan", "--model", "tiny", "--gpus", "8", "--gpu-type", "H1000"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean 'H100'" in err and "B200" in err and "A100-40GB" in err
    assert main(["plan", "--model", "tiny", "--gpus", "8", "--set", "gemm_peak_frac=0.5"]) == 2
    assert "gemm_peak_fraction" in capsys.readouterr().err


def test_assumption_override_changes_time(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpus", "8", "--layout", "dp=8 zero_stage=1", "--json"]
    main(args)
    base = json.loads(capsys.readouterr().out)["evaluation"]["time"]["compute_s"]
    main(args + ["--set", "gemm_peak_fraction=0.34"])  # half the H100 default
    slow = json.loads(capsys.readouterr().out)["evaluation"]["time"]["compute_s"]
    assert 1.6 * base < slow < 2 * base  # the GEMMs take twice as long, the rest does not


def test_model_and_hardware_files(tmp_path, capsys):
    model = tmp_path / "m.toml"
    model.write_text("[model]\nvocab_size = 1000\ndim = 512\nn_layers = 8\nn_heads = 8\n"
                     "max_seq_len = 1024\n")
    hw = tmp_path / "hw.toml"
    hw.write_text('[gpu.small]\nbase = "H100"\nmemory_bytes = 16e9\n\n'
                  "[gpu.mine]\npeak_flops = 100e12\nmemory_bytes = 24e9\n"
                  "memory_bandwidth = 1e12\nintra_node_bandwidth = 50e9\n"
                  "inter_node_bandwidth = 10e9\ngpus_per_node = 4\n")
    profiles = load_gpu_profiles(hw)
    assert profiles["small"].peak_flops == GPUS["H100"].peak_flops
    assert profiles["small"].memory_bytes == 16e9
    assert profiles["mine"].gpus_per_node == 4
    assert main(["plan", "--model", str(model), "--gpus", "4", "--gpu-type", "mine",
                 "--hardware", str(hw), "--top", "2"]) == 0
    assert "on 4 x mine (4 per node" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("[gpu.x]\npeak_flop = 1\n")
    with pytest.raises(PartitaError, match="peak_flops"):
        load_gpu_profiles(bad)


def test_gpus_that_do_not_fill_whole_nodes_are_noted(capsys):
    assert main(["plan", "--model", "tiny", "--gpus", "8", "--gpus-per-node", "3",
                 "--top", "1"]) == 0
    assert "8 GPUs do not fill whole nodes of 3" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny", "--gpus", "6", "--gpus-per-node", "3",
                 "--top", "1"]) == 0
    assert "whole nodes" not in capsys.readouterr().err


def test_a_runs_own_config_toml_plans_as_it_trained(tmp_path, capsys):
    from partita.config import load_config

    run = tmp_path / "config.toml"  # what `partita train` writes beside its results
    run.write_text(load_config(None, ["--model.n_layers=3", "--model.dim=64"]).to_toml())
    assert 'init_from = ""' in run.read_text()
    shape = tmp_path / "shape.toml"
    shape.write_text('[model]\nname = "tiny"\nn_layers = 3\ndim = 64\n')
    counts = []
    for model in (run, shape, "tiny"):
        assert main(["plan", "--model", str(model), "--gpus", "2", "--json"]) == 0
        counts.append(json.loads(capsys.readouterr().out)["parameters"])
    assert counts[0] == counts[1] != counts[2]


def test_catalog_entries_cite_sources():
    for name, gpu in GPUS.items():
        assert gpu.source and gpu.peak_flops > 1e14 and gpu.memory_bytes >= 40e9, name
    assert get_gpu("h100").name == "H100" and get_gpu("H100-SXM").name == "H100"


def test_local_cpu_profile():
    cpu = measure_local_cpu(budget_s=0.05, size=64)
    assert cpu.peak_flops > 1e8 and cpu.memory_bytes > 1e8 and cpu.gpus_per_node >= 1
    # One eager operation costs microseconds, not nothing and not milliseconds.
    assert 1e-7 < cpu.eager_op_s < 1e-3 and cpu.bf16_flops > 1e6


def test_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "mem.png"
    assert main(["plan", "--model", "tiny", "--gpus", "4", "--top", "3", "--png",
                 str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("command", [["plan", "--model", "tiny", "--gpus", "4"],
                                     ["schedule", "1f1b", "--stages", "2", "--microbatches", "2"]])
def test_a_png_that_cannot_be_written_is_refused_first(tmp_path, capsys, command):
    for png, says in ((tmp_path / "missing" / "x.png", "does not exist"),
                      (tmp_path, "is a folder")):
        assert main([*command, "--png", str(png)]) == 2
        captured = capsys.readouterr()
        assert says in captured.err and captured.out == ""  # nothing computed or printed


def test_implementation_chooses_whose_activations_are_counted(capsys):
    """`--implementation partita` counts partita's own eager model, loss transients
    included (see docs/benchmarks.md, "On a GPU"); fused is the GPU default."""
    memory = {}
    for impl in ("fused", "partita"):
        assert main(["plan", "--model", "llama3.2-1b", "--gpus", "1", "--gpu-type", "H200",
                     "--seq-len", "2048", "--global-batch", "4", "--layout", "microbatch_size=4",
                     "--implementation", impl, "--json"]) == 0
        memory[impl] = json.loads(capsys.readouterr().out)["evaluation"]["memory_bytes"]
    assert memory["fused"]["loss_transients"] == 0.0
    # bf16: the logits (forward) or their gradient (backward) beside the loss's saved
    # fp32 tensor, 2 bytes per logit (tests/unit/test_planner_memory.py measures it).
    assert memory["partita"]["loss_transients"] == pytest.approx(2 * 4 * 2048 * 128256)


def test_model_shape_fix_and_papers_metrics(capsys):
    shape = "layers=96,hidden=12288,heads=96,vocab=51200,seq=2048,flavour=gpt2"
    assert main(["plan", "--model-shape", shape, "--gpus", "384", "--gpu-type", "A100-80GB",
                 "--global-batch", "1536", "--fix", "tp=8,pp=12,zero_stage=distributed-optimizer",
                 "--json", "--top", "50"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["parameters"] > 174e9
    for ev in data["ranked"]:
        assert (ev["degrees"]["tp"], ev["degrees"]["pp"], ev["degrees"]["zero_stage"]) == (8, 12, 1)
        t = ev["time"]
        assert t["hardware_flops_per_gpu"] >= t["model_flops_per_gpu"] > 0
    assert any("seq-len 2048" in d for d in data["defaults_filled_in"])


def test_pins_that_leave_nothing_to_search_say_why(capsys):
    """`--fix` values no layout can take are bad input (exit 2), not an empty plan."""
    cases = [("llama3-8b", "tp=3", "tp=3 does not divide 8"),
             ("llama3-8b", "tp=2,pp=2,cp=1,dp=1", "= 4 does not equal 8"),
             ("llama3-8b", "ep=2", "this model has no experts"),
             ("mixtral-8x7b", "ep=3", "ep must divide the model's 8 experts"),
             ("llama3-8b", "pp=2,virtual_stages=17", "the model has 32 blocks"),
             ("llama3-8b", "virtual_stages=2,pp=1", "needs a pipeline")]
    for model, fix, reason in cases:
        assert main(["plan", "--model", model, "--gpus", "8", "--fix", fix]) == 2
        err = capsys.readouterr().err
        assert f"--fix {fix} leaves no layout to search on 8 GPUs" in err and reason in err
    # Each value is checked as a layout's is, before any search.
    for fix, reason in (("recompute=some", "recompute='some' is unknown"),
                        ("tp=0", "every degree is a positive integer"),
                        ("schedule=foo", "unknown pipeline schedule 'foo'")):
        assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--fix", fix]) == 2
        assert reason in capsys.readouterr().err
    # A pinned virtual stage count that splits the blocks unevenly is searched (the
    # trainer runs it), where the plain search keeps to even splits.
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--json",
                 "--fix", "pp=2,virtual_stages=3"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and all(ev["degrees"]["virtual_stages"] == 3 for ev in ranked)


def test_json_exit_status_is_zero_when_a_plan_is_printed(capsys):
    assert main(["plan", "--model", "llama3-70b", "--gpus", "64", "--layout", "dp=64",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["evaluation"]["fits"] is False
    assert main(["plan", "--model", "llama3-405b", "--gpus", "8", "--gpu-type", "A100-40GB",
                 "--global-batch", "64", "--seq-len", "2048", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is False


def test_closed_pipe_and_fast_start(tmp_path):
    """`partita plan | head -1` ends without a traceback, and the command never imports
    torch (it starts in well under a second)."""
    import os
    import subprocess
    import sys

    code = ("import sys; from partita.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(f"'{sys.executable}' -c \"{code}\" plan --model llama3-8b "
                          "--gpus 64 | head -1", shell=True, capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.stdout.startswith("llama3-8b") and "Traceback" not in proc.stderr
    # Every command ends quietly on a closed pipe, not only plan.
    proc = subprocess.run(f"'{sys.executable}' -m partita.cli schedule 1f1b --stages 4 "
                          "--microbatches 256 | head -1", shell=True, capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.stdout.startswith("1f1b") and "Traceback" not in proc.stderr, proc.stderr
    full = subprocess.run([sys.executable, "-c", code, "plan", "--model", "tiny", "--gpus",
                           "2"], capture_output=True, text=True, env=env, timeout=120)
    assert full.returncode == 0, full.stderr


def test_a_mixture_of_experts_plan_searches_ep_with_sequence_parallelism(capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any(r["degrees"]["ep"] > 1 for r in data["ranked"])
    assert "sequence_parallel on whenever tp > 1" in data["defaults_filled_in"]
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "32", "--fix", "tp=2",
                 "--seq-len", "4096", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and all(r["degrees"]["sequence_parallel"] for r in ranked)
    # One layout with tp: sequence parallelism is filled in on, and said so.
    main(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--layout", "tp=2 ep=8"])
    out = capsys.readouterr().out
    assert "not available yet" not in out
    assert "sequence_parallel=1 (on with tp > 1)" in out.splitlines()[-1]


def test_a_cpu_plan_takes_partita_trains_batch(capsys):
    """On this machine's CPU the plan is for `partita train` here: its 16 sequences per
    step, not the ~4M tokens (32768 tiny sequences) of a GPU cluster."""
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--gpu-type", "cpu", "--json",
                 "--top", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["global_batch"] == 16
    assert "--global-batch 16 (partita train's default)" in data["defaults_filled_in"]
    # fp32 there by default: no attention kernel to name. In bf16 the model's attention
    # setting, which decides whether scores are kept, is named; a shape naming its kernel
    # is not told.
    assert not any(d.startswith("model.attention") for d in data["defaults_filled_in"])
    told = {}
    for shape in ("", ",attention=sdpa"):
        assert main(["plan", "--model-shape", "layers=4,hidden=128,heads=4,vocab=256,seq=128"
                     + shape, "--gpus", "2", "--gpu-type", "cpu", "--precision", "bf16",
                     "--json", "--top", "1"]) == 0
        told[shape] = [d for d in json.loads(capsys.readouterr().out)["defaults_filled_in"]
                       if d.startswith("model.attention auto")]
    assert told[""] and not told[",attention=sdpa"]


def test_cpu_plans_of_one_sitting_share_one_measurement(capsys):
    """The second plan reads the profile the first kept ($PARTITA_CACHE_DIR, set by the
    test session), so both predict the same step; --remeasure measures again."""
    args = ["plan", "--model", "tiny", "--gpus", "1", "--gpu-type", "cpu", "--json",
            "--top", "1"]
    runs = []
    for extra in ([], [], ["--remeasure"]):
        assert main(args + extra) == 0
        runs.append(json.loads(capsys.readouterr().out))
    said = [next(d for d in r["defaults_filled_in"] if d.startswith("cpu profile"))
            for r in runs]
    assert "--remeasure measures again" in said[1] and "measured now" in said[2]
    assert runs[1]["ranked"][0]["time"] == runs[0]["ranked"][0]["time"]
    assert main(["plan", "--model", "tiny", "--gpus", "1", "--gpu-type", "H100",
                 "--remeasure"]) != 0
    assert "--remeasure measures this machine for --gpu-type cpu" in capsys.readouterr().err


def test_the_default_gpu_type_is_named(capsys):
    assert main(["plan", "--model", "tiny", "--gpus", "1", "--json", "--top", "1"]) == 0
    assert "--gpu-type H100" in json.loads(capsys.readouterr().out)["defaults_filled_in"]
