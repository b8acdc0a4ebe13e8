"""MFU's CPU peak counts the cores a process can have, not more."""

from __future__ import annotations

import torch

from partita import metrics


def test_a_cpu_peak_is_capped_by_the_processes_sharing_the_cores(monkeypatch, tmp_path):
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path))  # no rate kept from before
    monkeypatch.setattr(metrics, "matmul_rate", lambda size, budget: 1.0e9)
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
            monkeypatch.setattr(metrics, "matmul_rate", lambda size, budget, r=measured: r)
            assert metrics.device_peak_flops(torch.device("cpu")) == expected
    finally:
        torch.set_num_threads(threads)
