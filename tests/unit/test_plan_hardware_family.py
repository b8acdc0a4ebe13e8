"""A --hardware profile's GEMM rate follows its `base`, never its name: without a base
it is the documented default, and the plan says so."""

import json

import pytest

from partita.cli import main
from partita.planner import evaluate_layout, load_gpu_profiles
from partita.planner.compute import family_gemm_fraction

FIGURES = """peak_flops = 989e12
memory_bytes = 80e9
memory_bandwidth = 3.35e12
intra_node_bandwidth = 450e9
inter_node_bandwidth = 50e9
"""
LAYOUT = "dp=8 tp=8 zero_stage=1 microbatch_size=1 recompute=full"


@pytest.fixture
def profiles(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text(f"[gpu.H100-custom]\n{FIGURES}[gpu.my-h100]\n{FIGURES}"
                    '[gpu.based]\nbase = "H100"\n'
                    '[gpu.based-twice]\nbase = "based"\ninter_node_bandwidth = 25e9\n'
                    '[gpu.on-unnamed]\nbase = "my-h100"\n')
    return str(path)


def test_the_name_of_a_profile_does_not_choose_its_gemm_rate(profiles):
    gpus = load_gpu_profiles(profiles)
    assert family_gemm_fraction(gpus["H100-custom"]) == 0.75
    assert family_gemm_fraction(gpus["my-h100"]) == 0.75
    assert family_gemm_fraction(gpus["on-unnamed"]) == 0.75
    # A base (directly or through another profile's) brings the catalog family's.
    assert family_gemm_fraction(gpus["based"]) == 0.68
    assert family_gemm_fraction(gpus["based-twice"]) == 0.68
    steps = [evaluate_layout("llama3-8b", 64, LAYOUT, gpu_type=name,
                             hardware_file=profiles).time["step_s"]
             for name in ("H100-custom", "my-h100")]
    assert steps[0] == steps[1]


def test_the_default_gemm_rate_is_printed_with_how_to_set_it(profiles, capsys):
    argv = ["plan", "--model", "llama3-8b", "--gpus", "64", "--hardware", profiles,
            "--gpu-type", "H100-custom", "--layout", LAYOUT]
    assert main(argv) == 0
    defaults = next(x for x in capsys.readouterr().out.splitlines()
                    if x.startswith("Defaults filled in:"))
    assert ('gemm_peak_fraction 0.75 (no base GPU given: set base = "H100" (or another '
            "catalog GPU) in [gpu.H100-custom], or --set gemm_peak_fraction=...)") in defaults
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["assumptions"]["gemm_peak_fraction"] == 0.75
    assert any(d.startswith("gemm_peak_fraction 0.75") for d in data["defaults_filled_in"])
    # With a base, or a value set, there is nothing to say.
    for extra in (["--gpu-type", "based"], ["--set", "gemm_peak_fraction=0.6"]):
        assert main([*argv, *extra]) == 0
        assert "gemm_peak_fraction" not in capsys.readouterr().out
