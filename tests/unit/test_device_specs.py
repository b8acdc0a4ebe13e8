"""The CPU's 16-bit matmul check that warns before mixed precision slows a run down."""

import pytest

from partita import device_specs
from partita.device_specs import slow_cpu_matmul_warning, training_matmul_rate


def _rates(monkeypatch, fp32: float, half: float) -> None:
    monkeypatch.setattr(device_specs, "training_matmul_rate",
                        lambda size, budget_s, dtype_name="bfloat16":
                        fp32 if dtype_name == "float32" else half)


def test_slow_16_bit_matmuls_are_named_with_the_fix(monkeypatch):
    _rates(monkeypatch, fp32=60e9, half=5e9)
    warning = slow_cpu_matmul_warning("bfloat16")
    assert warning is not None
    assert "bfloat16 matmuls run at 5.0 GFLOP/s" in warning
    assert "12x slower than float32 (60 GFLOP/s)" in warning
    assert "precision.param_dtype" in warning


def test_16_bit_matmuls_that_keep_up_pass_quietly(monkeypatch):
    _rates(monkeypatch, fp32=60e9, half=45e9)  # a CPU with AMX or AVX512-BF16
    assert slow_cpu_matmul_warning("float16") is None


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_training_matmul_rate_measures_each_dtype(dtype_name):
    assert training_matmul_rate(32, 0.01, dtype_name) > 0
