"""`--set` refuses a setting given twice, as --fix, --layout and --model-shape do."""

from partita.cli import main


def test_set_twice_is_refused(capsys):
    argv = ["plan", "--model", "llama3-8b", "--gpus", "8", "--layout", "dp=8",
            "--set", "gemm_peak_fraction=0.6", "--set", "gemm_peak_fraction=0.7"]
    assert main(argv) == 2
    assert ("--set gives gemm_peak_fraction twice (gemm_peak_fraction=0.6 and "
            "gemm_peak_fraction=0.7); give each name once.") in capsys.readouterr().err
    # Two different settings are fine.
    assert main([*argv[:-1], "memory_efficiency=0.7"]) in (0, 1)
