"""MFU's CPU peak counts the cores a process can have, not more."""

from __future__ import annotations

import torch

from partita import metrics


def test_a_cpu_peak_is_capped_by_the_processes_sharing_the_cores(monkeypatch):
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
