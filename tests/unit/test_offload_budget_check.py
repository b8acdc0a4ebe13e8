"""The pre-launch check of `parallel.host_memory_budget_gb` (disk offload) takes the
budget the engine takes, on the device the run uses.

On the CPU the engine reads the gradients where they are, so its buffer sets hold no
gradient; the check counted one per set anyway and refused budgets the engine runs
in, quoting a minimum a third above the engine's. It also counted the gradients in the
parameter dtype, where the engine updates from the owned gradient slice's dtype.
"""

from __future__ import annotations

import pytest
import torch

from partita.errors import PartitaError
from partita.memory.disk import ALIGN, MIN_SUBGROUP, SETS, DiskOptimizer
from partita.parallelize import check_layout
from partita.testing import parity_config

# float32 master weights and moments: 12 bytes an element per set.
ON_CPU = SETS * 12 * MIN_SUBGROUP + ALIGN  # 151552: what the engine takes on the CPU
ON_GPU = SETS * 16 * MIN_SUBGROUP + ALIGN  # 200704: a float32 gradient staged per set


def _check(tmp_path, budget: int, device: str = "cpu", **precision) -> None:
    cfg = parity_config(train=dict(dtype="float32", device=device), precision=precision,
                        parallel=dict(offload="optimizer+disk", offload_dir=str(tmp_path),
                                      host_memory_budget_gb=budget / 1e9,
                                      zero_stage=precision.pop("zero_stage", 1)))
    check_layout(cfg, cfg.model_config(), cfg.layout(1), 1)


def _engine(tmp_path, budget: int, grad_dtype: torch.dtype = torch.float32) -> None:
    DiskOptimizer.create([torch.zeros(3 * MIN_SUBGROUP)], [grad_dtype], [[]], torch.float32,
                         str(tmp_path), budget, "probe").close()


def test_on_the_cpu_the_check_takes_the_engines_budget(tmp_path):
    _engine(tmp_path, ON_CPU)
    _check(tmp_path, ON_CPU)
    with pytest.raises(PartitaError, match="sub-group"):
        _engine(tmp_path, ON_CPU - 1)
    with pytest.raises(PartitaError, match=f"need {ON_CPU} bytes"):
        _check(tmp_path, ON_CPU - 1)


def test_on_a_gpu_the_check_counts_the_staged_gradients(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(PartitaError, match=f"need {ON_GPU} bytes"):
        _check(tmp_path, ON_CPU, device="auto")
    _check(tmp_path, ON_GPU, device="cuda")


def test_the_check_counts_the_gradients_in_the_dtype_the_engine_updates_from(tmp_path):
    """bf16 parameters whose gradients are reduced into float32 shards (ZeRO-2): the
    engine updates from float32 gradients, so no cast scratch; nor does the check."""
    _engine(tmp_path, ON_CPU, torch.float32)
    _check(tmp_path, ON_CPU, param_dtype="bfloat16", reduce_dtype="float32", zero_stage=2)
