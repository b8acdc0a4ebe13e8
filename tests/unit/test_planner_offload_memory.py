"""The planner's host bytes of disk offload against the engine's own buffers.

`planner.disk_buffers` repeats `partita.memory.disk`'s sizing rule (the planner imports
no torch): its constants, its sub-group and its `buffer_bytes` must be the engine's,
whether the budget or the largest bucket sizes the sub-group, with gradients staged (a
GPU) or read in place (a CPU), with and without the parameters on disk. The end-to-end
check against a training step's ledger is tests/dist/test_planner_offload_memory.py.
"""

from __future__ import annotations

import pytest
import torch

from partita.memory import disk
from partita.optim import adamw
from partita.planner import Layout, PlanModel, Precision
from partita.planner import disk_buffers as planned
from partita.planner.assumptions import Assumptions
from partita.planner.memory import host_state_bytes, owned_elements

PRECISIONS = {"fp32": (Precision.fp32(), torch.float32, torch.float32, torch.float32),
              "bf16": (Precision(), torch.bfloat16, torch.bfloat16, torch.float32),
              "bf16-fp32-grads": (Precision(grad=4), torch.bfloat16, torch.float32,
                                  torch.float32)}


def test_constants_are_the_engines() -> None:
    assert (planned.SETS, planned.ALIGN, planned.STATES) == (disk.SETS, disk.ALIGN,
                                                              len(disk.STATES))
    assert planned.CPU_CHUNK == adamw.CPU_CHUNK


@pytest.mark.parametrize("name", sorted(PRECISIONS))
@pytest.mark.parametrize("stage_grads", [False, True])
@pytest.mark.parametrize("params_on_disk", [False, True])
@pytest.mark.parametrize("sizes,budget", [
    ([300_000, 5_000], 4e6),   # the budget sizes the sub-group
    ([70_001, 3], 4e7),        # the largest bucket does (not a whole granule)
    ([200], 4e7),              # a bucket smaller than one granule
])
def test_buffer_bytes_are_what_the_engine_allocates(tmp_path, name, stage_grads,
                                                    params_on_disk, sizes, budget) -> None:
    precision, param, grad, master = PRECISIONS[name]
    engine = disk.DiskOptimizer(sizes, [[] for _ in sizes], master, grad, tmp_path,
                                int(budget), "t", param if params_on_disk else None,
                                stage_grads, direct=False)
    assert planned.subgroup_elements(budget, precision, stage_grads, params_on_disk) == \
        disk.subgroup_elements(int(budget), master, grad,
                               param if params_on_disk else None, stage_grads)
    assert planned.buffer_bytes(max(sizes), budget, precision, stage_grads,
                                params_on_disk) == engine.buffer_bytes()


def _model() -> PlanModel:
    from partita.bench.plan_measure import Case, plan_model

    return plan_model(Case())


def test_a_budget_that_does_not_bind_holds_three_sets_of_the_one_bucket() -> None:
    """A small model (one bucket) at a 1 GB budget: the engine's sub-group is that
    bucket, so it holds SETS copies of its states, not one (nor the budget)."""
    model, precision = _model(), Precision.fp32()
    layout = Layout(offload="optimizer+disk")
    a = Assumptions.measured_cpu()  # on a CPU: no staged gradient
    owned = owned_elements(model, layout, precision, 0, a)
    host = host_state_bytes(model, layout, precision, 0, a)
    per = 3 * 4
    assert host >= 3 * per * owned
    assert host < 3 * per * (owned + 1024) + 4096
    # On a GPU each set stages its gradient too.
    gpu = host_state_bytes(model, layout, precision, 0, Assumptions.partita_on_gpu())
    assert gpu - host == pytest.approx(3 * 4 * (host - 4096) / (3 * per), rel=1e-9)
