"""Pipeline parallelism inside `build_parallel_model`, in three calls at fixed points:

    setup = prepare_pipeline(cfg, model_cfg, mesh)  # validates; before anything waits
    setup.cut(model, plan)                           # meta model -> this rank's stages
    ... tensor parallel ...
    setup.detach_tied(model, plan)                   # before materialising
    ... materialise, data-parallel engine ...
    runner = setup.runner(dp, loss_fn, device, mesh, plan)

Everything a user can get wrong (unknown schedule, too few microbatches for it, more
stages than blocks, ZeRO-3) raises PartitaError in `prepare_pipeline`, on every rank
alike, before any process waits on another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from partita.errors import PartitaError
from partita.mesh import Mesh, ParallelDims
from partita.models.config import ModelConfig
from partita.models.plan import ModelPlan
from partita.pipeline.actions import Schedule
from partita.pipeline.p2p import check_transfer_order
from partita.pipeline.runtime import PipelineRunner
from partita.pipeline.schedules import ALIASES, build_schedule
from partita.pipeline.stage import (
    StageLayout,
    detach_tied_copy,
    keep_stages,
    local_stages,
    plan_stages,
    stage_parameters,
)
from partita.pipeline.validate import validate

ZERO3_REASON = (
    "ZeRO stage 3 with pipeline parallelism (parallel.pp > 1) is not supported: stage 3 "
    "gathers each block's parameters around its forward and backward and frees them "
    "after, but a pipeline stage runs the forwards and backwards of many microbatches "
    "interleaved, so every block would be gathered again for every microbatch and pass "
    "(about 3 x microbatches all-gathers per step instead of 3), and a zero-bubble W pass "
    "would need them once more. Use parallel.zero_stage=2 with the pipeline (gradients "
    "and optimizer state stay sharded), or drop the pipeline to use stage 3."
)


@dataclass(frozen=True)
class PipelineSetup:
    layout: StageLayout
    schedule: str
    virtual: int
    microbatches: int
    rank: int  # pipeline coordinate of this process
    seq_len: int
    dim: int
    seq_divisor: int
    timeout_s: float

    def cut(self, model: nn.Module, plan: ModelPlan) -> None:
        keep_stages(model, plan, self.layout, self.rank)

    def detach_tied(self, model: nn.Module, plan: ModelPlan) -> None:
        detach_tied_copy(model, plan, self.layout, self.rank)

    def bucket_key(self, model: nn.Module, plan: ModelPlan) -> Callable[[str], object] | None:
        """This rank's stage of each parameter, by name, when it holds several: gradient
        buckets then never span two stages, and each stage's can be reduced during its
        last backward of the step."""
        stages = local_stages(self.layout, self.rank)
        if len(stages) == 1:
            return None
        owner = {id(p): s.index for s in stages for p in stage_parameters(model, plan, s)}
        return {name: owner.get(id(p)) for name, p in model.named_parameters()}.get

    def runner(self, dp, loss_fn, device: torch.device, mesh: Mesh,
               plan: ModelPlan) -> PipelineRunner:
        return PipelineRunner(dp, loss_fn, device, mesh, plan, self.layout, self.schedule,
                              self.microbatches, self.seq_len, self.dim, self.seq_divisor,
                              self.timeout_s, self.virtual)


def check_pipeline(cfg, model_cfg: ModelConfig, dims: ParallelDims) -> tuple[Schedule,
                                                                           StageLayout]:
    """Validate the pipeline settings; the schedule and the stage split. Pure: no process
    group, so the launcher can call it before starting any worker."""
    par = cfg.parallel
    if dims.zero_stage == 3:
        raise PartitaError(ZERO3_REASON)
    name = ALIASES.get(par.schedule.strip().lower(), par.schedule.strip().lower())
    del name  # build_schedule resolves aliases itself
    # parallel.virtual_stages = 0 means the schedule's own default (2 for interleaved).
    sched = build_schedule(par.schedule, dims.pp, cfg.train.microbatches,
                           par.virtual_stages or None)
    validate(sched)
    check_transfer_order(sched)
    layout = plan_stages(model_cfg, dims.pp, sched.n_virtual, par.pp_balance,
                         cfg.data.seq_len)
    if par.sequence_parallel and cfg.data.seq_len % dims.tp:
        raise PartitaError(
            f"data.seq_len={cfg.data.seq_len} must be divisible by parallel.tp={dims.tp} "
            "under sequence parallelism: pipeline stages exchange sequence shards."
        )
    return sched, layout


def prepare_pipeline(cfg, model_cfg: ModelConfig, mesh: Mesh) -> PipelineSetup:
    """Check the pipeline settings and decide this rank's part (no communication)."""
    dims = mesh.dims
    sched, layout = check_pipeline(cfg, model_cfg, dims)
    seq_divisor = dims.tp if cfg.parallel.sequence_parallel else 1
    timeout = float(cfg.parallel.pp_timeout_s)
    return PipelineSetup(layout, sched.name, sched.n_virtual, cfg.train.microbatches,
                         mesh.coord.pp, cfg.data.seq_len, model_cfg.dim, seq_divisor, timeout)
