"""The kernel-level compute model: roofline, tile quantisation, short inner dimensions."""

import pytest

from partita.planner import Assumptions, get_gpu
from partita.planner.compute import GEMM_PEAK_FRACTION, gemm_fraction, gemm_time

A100, H100 = get_gpu("A100-80GB"), get_gpu("H100")
NO_OVERHEAD = Assumptions(kernel_overhead_s=0.0)


def _rate(m, n, k, gpu=H100, a=NO_OVERHEAD):
    return 2 * m * n * k / gemm_time(m, n, k, gpu, a)


def test_large_gemm_runs_at_the_family_rate():
    big = _rate(8192, 8192, 8192)
    k_factor = 8192 / (8192 + NO_OVERHEAD.gemm_k_half)
    assert big == pytest.approx(H100.peak_flops * GEMM_PEAK_FRACTION["H100"] * k_factor)
    assert gemm_fraction(A100, NO_OVERHEAD) == GEMM_PEAK_FRACTION["A100"]
    assert gemm_fraction(H100, Assumptions(gemm_peak_fraction=0.5)) == 0.5


def test_tile_quantisation_charges_whole_tiles():
    t1024 = gemm_time(8192, 1024, 8192, H100, NO_OVERHEAD)
    # (1032: aligned to 8 elements, so only the tiles differ; see the misaligned test)
    t1032 = gemm_time(8192, 1032, 8192, H100, NO_OVERHEAD)
    t1152 = gemm_time(8192, 1152, 8192, H100, NO_OVERHEAD)  # 9 whole tiles of 128
    assert t1032 == pytest.approx(t1152) and t1032 == pytest.approx(t1024 * 1152 / 1024)


def test_short_inner_dimension_is_slower_per_flop():
    # Large m and n keep these compute-bound (small K alone would make them memory-bound).
    rates = [_rate(8192, 8192, k) for k in (256, 512, 1024, 4096)]
    assert rates == sorted(rates)
    assert rates[0] == pytest.approx(rates[-1] * (256 / 320) / (4096 / 4160), rel=1e-6)


def test_thin_gemm_is_memory_bound():
    """One row (a token) against a 8192 x 8192 weight: reading the weight dominates."""
    t = gemm_time(1, 8192, 8192, H100, NO_OVERHEAD)
    weight_bytes = 2 * 8192 * 8192
    assert t == pytest.approx(weight_bytes / (H100.memory_bandwidth * 0.8), rel=0.01)
    assert _rate(1, 8192, 8192) < 0.01 * H100.peak_flops
