"""Turn a single-device model description into this rank's parallel training model.

The order is fixed and documented, because each step reads what the previous one left:

1. build the model on the meta device (no memory, names and shapes only);
2. pipeline: keep only the blocks, embedding and head of this rank's stages;
3. tensor parallel: swap planned modules for their parallel versions (meta shards,
   each parameter tagged with ShardInfo);
4. data parallel / ZeRO: the engine that reduces gradients and steps the optimizer; it
   also materialises each parameter from its global name, drawing only the local slice
   (for ZeRO-3 only its flat 1/N of that slice).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from partita.config import Config
from partita.errors import PartitaError
from partita.layout import Layout, validate
from partita.loss import cross_entropy  # the whole vocabulary on one rank
from partita.mesh import Mesh
from partita.models.config import ModelConfig
from partita.models.transformer import Transformer

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16, "fp64": torch.float64}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def parse_dtype(name: str, key: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise PartitaError(
            f"{key}='{name}' is not a dtype partita trains in; use one of "
            "float32, bfloat16, float16, float64."
        ) from None


def dims_from_config(cfg: Config, world_size: int) -> Layout:
    """The run's Layout for `world_size` processes (see `Config.layout`)."""
    return cfg.layout(world_size)


class MicrobatchRunner:
    """Forward and backward of one rank's batch without a pipeline: microbatches in turn.

    Only the last microbatch's backward lets the data-parallel engine communicate, so
    gradient accumulation costs no communication.
    """

    def __init__(self, dp, loss_fn: LossFn, device: torch.device) -> None:
        self.dp, self.loss_fn, self.device = dp, loss_fn, device

    def train(self, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int) -> float:
        """Accumulate gradients of mean loss / microbatches; return this rank's loss."""
        losses = []
        pairs = list(zip(inputs.chunk(microbatches), targets.chunk(microbatches)))
        for i, (x, y) in enumerate(pairs):
            with self.dp.grad_sync(i == len(pairs) - 1):
                loss = self.loss_fn(self.dp.module(x.to(self.device)), y.to(self.device))
                loss = loss / microbatches
                self.dp.backward(loss)
            losses.append(loss.detach())
        # One device-to-host read per step, not one per microbatch (each is a sync).
        return torch.stack(losses).sum().item()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        return self.loss_fn(self.dp.module(inputs.to(self.device)),
                            targets.to(self.device)).item()


@dataclass
class ParallelModel:
    """Everything a training step needs on this rank."""

    model_cfg: ModelConfig
    mesh: Mesh
    dp: object  # partita.zero.DataParallel
    loss_fn: LossFn
    device: torch.device
    runner: MicrobatchRunner  # or a pipeline runner with the same two methods

    @property
    def module(self) -> nn.Module:
        return self.dp.module


def engine_policies(cfg: Config):
    """The data-parallel engine's ZeRO, mixed-precision and optimizer policies."""
    from partita.zero import AdamWConfig, MixedPrecision, ZeroConfig

    param_dtype = parse_dtype(cfg.precision.param_dtype or cfg.train.dtype,
                              "precision.param_dtype")
    reduce_dtype = parse_dtype(cfg.precision.reduce_dtype or cfg.precision.param_dtype
                               or cfg.train.dtype, "precision.reduce_dtype")
    master = torch.float64 if param_dtype == torch.float64 else torch.float32
    zero = ZeroConfig(stage=cfg.parallel.zero_stage, bucket_mb=cfg.parallel.bucket_mb,
                      prefetch=cfg.parallel.prefetch, accumulation=cfg.parallel.accumulation)
    precision = MixedPrecision(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype,
        master_dtype=master if cfg.precision.master_weights else param_dtype)
    optim = AdamWConfig(lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2),
                        eps=cfg.train.eps, weight_decay=cfg.train.weight_decay)
    return zero, precision, optim


def check_layout(cfg: Config, model_cfg: ModelConfig, layout: Layout,
                 world_size: int | None = None) -> None:
    """Reject unsupported settings before any process waits on another: the engine's
    policies, then every rule of `partita.layout.validate` at once."""
    engine_policies(cfg)  # constructing the policies validates them
    validate(layout, model_cfg, layout.world_size if world_size is None else world_size,
             seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch)


def build_parallel_model(cfg: Config, mesh: Mesh, device: torch.device) -> ParallelModel:
    from partita.zero import DataParallel
    from partita.zero.init import model_init_fn

    model_cfg = cfg.model_config()
    layout = cfg.layout(mesh.world_size)
    check_layout(cfg, model_cfg, layout, mesh.world_size)
    if layout.degrees != mesh.dims:
        raise PartitaError(f"the mesh was built for {mesh.dims} but the configuration "
                           f"asks for {layout.degrees}; build both from one Layout.")
    zero, precision, optim = engine_policies(cfg)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    plan = model.plan()
    pipeline = None
    if layout.pp > 1:  # pipeline: keep only this rank's stages (see partita.pipeline.build)
        from partita.pipeline.build import prepare_pipeline

        pipeline = prepare_pipeline(cfg, model_cfg, mesh, layout)
        pipeline.cut(model, plan)
    loss_fn: LossFn = cross_entropy
    if layout.tp > 1:
        from partita.tensor_parallel import apply_tensor_parallel

        # Dropout masks must differ between replicas (they see different tokens).
        report = apply_tensor_parallel(model, plan, mesh.comm("tensor"),
                                       sequence_parallel=cfg.parallel.sequence_parallel,
                                       dropout_seed=cfg.data.seed + mesh.index("loss_average"))
        loss_fn = report.loss_fn

    bucket_key = None
    if pipeline is not None:  # a tied head's copy of the embedding is not a parameter
        pipeline.detach_tied(model, plan)
        bucket_key = pipeline.bucket_key(model, plan)
    # The engine materialises every parameter still on the meta device from its global
    # name: the whole local tensor for stages 0-2, only the owned flat slice for stage 3.
    # Values are drawn in float32 exactly as build_model draws them, then cast.
    dp = DataParallel(
        model, mesh, zero=zero, precision=precision, optim=optim,
        init_fn=model_init_fn(model_cfg), device=device, bucket_key=bucket_key,
    )
    runner = (pipeline.runner(dp, loss_fn, device, mesh, plan) if pipeline is not None
              else MicrobatchRunner(dp, loss_fn, device))
    return ParallelModel(model_cfg=model_cfg, mesh=mesh, dp=dp, loss_fn=loss_fn,
                         device=device, runner=runner)
