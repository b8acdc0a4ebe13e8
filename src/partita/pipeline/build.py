"""Pipeline parallelism inside `build_parallel_model`, in three calls at fixed points:

    setup = prepare_pipeline(cfg, model_cfg, mesh, layout)  # the schedule, built once
    setup.cut(model, plan)                                   # meta model -> my stages
    ... tensor parallel ...
    setup.detach_tied(model, plan)                           # before materialising
    ... materialise, data-parallel engine ...
    runner = setup.runner(dp, loss_fn, device, mesh, plan)  # gets the Schedule object

What a user can get wrong (too few microbatches for the schedule, more stages than
blocks, ZeRO-3) is a rule of `partita.layout_rules.validate`, which runs before this. Here the
schedule is built, proven free of deadlocks and handed on as an object: once per process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from partita.layout import Layout
from partita.mesh import Mesh
from partita.models.model_config import ModelConfig
from partita.models.plan import ModelPlan
from partita.pipeline.actions import Schedule
from partita.pipeline.p2p import validated_schedule
from partita.pipeline.runtime import PipelineRunner
from partita.pipeline.stage import (
    StageLayout,
    check_stage_model,
    detach_tied_copy,
    keep_stages,
    local_stages,
    plan_stages,
    stage_parameters,
)


@dataclass(frozen=True)
class PipelineSetup:
    layout: StageLayout
    schedule: Schedule  # built and validated once, for the step's microbatch count
    rank: int  # pipeline coordinate of this process
    seq_len: int
    dim: int
    seq_divisor: int
    timeout_s: float

    def cut(self, model: nn.Module, plan: ModelPlan) -> None:
        check_stage_model(model, plan, self.layout)
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
                              self.seq_len, self.dim, self.seq_divisor, self.timeout_s)


def pipeline_schedule(layout: Layout, microbatches: int) -> Schedule:
    """The layout's schedule for `microbatches`, validated and proven to deliver every
    transfer in order. Pure: no process group."""
    return validated_schedule(layout.schedule, layout.pp, microbatches, layout.virtual_stages)


def prepare_pipeline(cfg, model_cfg: ModelConfig, mesh: Mesh, layout: Layout) -> PipelineSetup:
    """This rank's part of the pipeline: the stage split and the schedule (no
    communication). `layout` has passed `partita.layout_rules.validate`."""
    sched = pipeline_schedule(layout, cfg.train.microbatches)
    stages = plan_stages(model_cfg, layout.pp, sched.n_virtual, cfg.parallel.pp_balance,
                         cfg.data.seq_len)
    # Stages pass each rank's share of the sequence: its context-parallel chunks, and of
    # those its tensor-parallel slice under sequence parallelism.
    seq_divisor = (layout.tp if layout.sequence_parallel else 1) * layout.cp
    return PipelineSetup(stages, sched, mesh.coord.pp, cfg.data.seq_len, model_cfg.dim,
                         seq_divisor, float(cfg.parallel.pp_timeout_s))
