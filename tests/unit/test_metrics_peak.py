"""MFU's CPU peak: the cores a process can have, not more; the rate of the dtype it
computes in where that is the faster."""

from __future__ import annotations

import torch

from partita import metrics


def test_a_cpu_peak_is_capped_by_the_processes_sharing_the_cores(monkeypatch, tmp_path):
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path))  # no rate kept from before
    monkeypatch.setattr(metrics, "matmul_rate", lambda size, budget, dtype: 1.0e9)
    monkeypatch.setattr(metrics, "_cores", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two one-thread processes, two cores
        assert metrics.device_peak_flops(torch.device("cpu")) == 1.0e9
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four on two cores: half a core each
        assert metrics.device_peak_flops(torch.device("cpu")) == 0.5e9
        assert metrics.device_peak_flops(torch.device("cpu"), 3.0) == 3.0e12  # as set
    finally:
        torch.set_num_threads(threads)


def test_measuring_the_peak_leaves_the_global_random_stream_alone():
    """A run measures the CPU's rate after a resume restored its random streams; had
    the measurement drawn from the global generator, a dropout run resumed in the same
    layout would no longer match the run it continues."""
    from partita.device_specs import slow_cpu_matmul_warning

    torch.manual_seed(1234)
    before = torch.get_rng_state()
    metrics.device_peak_flops(torch.device("cpu"))
    slow_cpu_matmul_warning("bfloat16", budget_s=0.01)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_start_on_a_busy_machine_divides_by_the_best_rate_kept(monkeypatch, tmp_path):
    """A start measured while other work shared the cores read 106% MFU; the best rate
    measured on the machine within a day stands for it."""
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for measured, expected in ((2.0e9, 2.0e9), (0.7e9, 2.0e9), (3.0e9, 3.0e9)):
            monkeypatch.setattr(metrics, "matmul_rate", lambda size, budget, dtype, r=measured: r)
            assert metrics.device_peak_flops(torch.device("cpu")) == expected
    finally:
        torch.set_num_threads(threads)


def test_a_16_bit_run_divides_by_the_16_bit_rate_where_it_is_faster(monkeypatch, tmp_path):
    """A bf16 run on a Zen 4 CPU (bf16 products at twice the float32 rate) read 160%
    MFU against the float32 rate. Where 16-bit products are slower (a CPU without 16-bit
    units) the float32 rate stays: the peak is the faster way to multiply."""
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu = torch.device("cpu")
        rates = {"float32": 1.0e9, "bfloat16": 2.0e9, "float16": 0.1e9}
        monkeypatch.setattr(metrics, "matmul_rate", lambda size, budget, dtype: rates[dtype])
        assert metrics.device_peak_flops(cpu, compute_dtype="bfloat16") == 2.0e9
        assert metrics.device_peak_flops(cpu, compute_dtype="float16") == 1.0e9
        assert metrics.device_peak_flops(cpu, compute_dtype="float32") == 1.0e9
        assert metrics.device_peak_flops(cpu) == 1.0e9
    finally:
        torch.set_num_threads(threads)
