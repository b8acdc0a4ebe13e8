"""Turn a single-device model and its plan into this rank's parallel training model.

    pm = parallelize(model, plan, cfg, mesh, device)   # any model built on meta + its plan
    pm = build_parallel_model(cfg, mesh, device)       # partita's own Transformer from cfg
    loss = pm.runner.train(inputs, targets, microbatches)

The order is fixed, because each step reads what the previous one left. Each step is a
function from one explicit object to the next:

1. the caller builds the model on the meta device (names and shapes, no memory) and
   hands it over with its `ModelPlan` (roles, blocks, init rule, shape); a model built
   with its values instead takes global rank 0's on every rank (`start_from_first_rank`);
2. `cut_pipeline`: ModelPlan + meta model -> `PipelineCut`, holding only the blocks,
   embedding and head of this rank's pipeline stages (block names stay global);
3. `shard_tensor_parallel`: PipelineCut -> `ShardedModel`, planned modules swapped for
   their tensor-parallel versions (meta shards, each parameter tagged with ShardInfo),
   and the loss that matches the (possibly vocabulary-sharded) logits; with cp > 1,
   `shard_context_parallel` then swaps the plan's attention cores for ring (or
   all-gather) attention over the context group; `apply_expert_parallel` keeps each
   MoE block's share of the experts (ep > 1) and sends tokens to them by all-to-all;
4. `recompute`: the blocks (or attention cores) the layout's recompute policy names
   rerun their forward in backward (`partita.memory.recompute`); after tensor
   parallelism, so the rerun is the sharded forward, and before the engine, whose
   hooks stay around the blocks;
5. `wrap_data_parallel`: ShardedModel -> `DataParallel`, the engine that reduces
   gradients and steps the optimizer; it materialises each parameter from its global
   name with the plan's init rule, drawing only the local slice (for ZeRO-3 only its
   flat 1/N of that slice);
6. `make_runner`: the `StepRunner` that runs a step's microbatches (a pipeline schedule
   or microbatches in turn).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn

from partita.comm import GroupComm
from partita.compile import (
    CompilePolicy,
    CompileReport,
    compile_blocks,
    compile_model,
    compiled_units,
    model_refusal,
    resolve_mode,
)
from partita.config import Config
from partita.context_parallel import ContextParallelRunner, apply_context_parallel
from partita.errors import PartitaError
from partita.experts import MoERunner, apply_expert_parallel
from partita.layout import Layout, ZeroStage
from partita.layout_rules import validate
from partita.loss import (  # cross_entropy: vocab on one rank
    check_microbatches,
    cross_entropy,
    microbatch_weight,
)
from partita.memory import OffloadPolicy, RecomputePolicy, RecomputeReport, apply_recompute
from partita.memory.disk import check_offload_dir, disk_bytes_needed, subgroup_elements
from partita.mesh import Mesh
from partita.models.hf_weights import HFWeights
from partita.models.model_config import ModelConfig
from partita.models.plan import ModelPlan
from partita.models.transformer import Transformer
from partita.optim import AdamWConfig
from partita.pipeline.build import PipelineSetup, prepare_pipeline
from partita.tensor_parallel import (
    TensorParallelReport,
    apply_tensor_parallel,
)
from partita.tensor_parallel.plan_check import check_patterns_match
from partita.zero import DataParallel, MixedPrecision, ZeroConfig, model_init_fn

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16, "fp64": torch.float64}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@runtime_checkable
class StepRunner(Protocol):
    """Runs one rank's share of a step; `MicrobatchRunner` and the pipeline's
    `PipelineRunner` both are one."""

    def train(self, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
              segments: torch.Tensor | None = None,
              targets_per_rank: float | None = None) -> float:
        """Forward and backward of `microbatches` equal microbatches, gradients
        accumulated as of mean loss / microbatches; this rank's summed loss.
        `segments` (like inputs): the document of every token when rows pack several
        documents (partita.models.documents); attention then stays within each.
        `targets_per_rank`: when some targets are not trained, the step's trained
        targets over the ranks the loss is averaged on (partita.loss.microbatch_weight):
        the step's loss is then their mean, at any layout."""
        ...

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 segments: torch.Tensor | None = None,
                 targets_per_rank: float | None = None) -> float:
        """The loss of one batch, no gradients."""
        ...


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

    def __init__(self, dp: DataParallel, loss_fn: LossFn, device: torch.device) -> None:
        self.dp, self.loss_fn, self.device = dp, loss_fn, device

    def train(self, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
              segments: torch.Tensor | None = None,
              targets_per_rank: float | None = None) -> float:
        """Accumulate gradients of mean loss / microbatches; return this rank's loss."""
        check_microbatches(inputs.shape[0], microbatches)
        losses = []
        pairs = list(zip(inputs.chunk(microbatches), targets.chunk(microbatches)))
        docs = [None] * len(pairs) if segments is None else segments.chunk(microbatches)
        for i, ((x, y), s) in enumerate(zip(pairs, docs)):
            with self.dp.grad_sync(i == len(pairs) - 1):
                loss = self.loss_fn(self._forward(x, s), y.to(self.device))
                # x 1.0 (every target trained, or no count given) is exact.
                loss = loss * microbatch_weight(y, microbatches, targets_per_rank) / microbatches
                self.dp.backward(loss)
            losses.append(loss.detach())
        # One device-to-host read per step, not one per microbatch (each is a sync).
        return torch.stack(losses).sum().item()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 segments: torch.Tensor | None = None,
                 targets_per_rank: float | None = None) -> float:
        loss = self.loss_fn(self._forward(inputs, segments), targets.to(self.device)).item()
        return loss * microbatch_weight(targets, 1, targets_per_rank)

    def _forward(self, x: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        if segments is None:  # models that know nothing of packed documents work too
            return self.dp.module(x.to(self.device))
        return self.dp.module(x.to(self.device), segments=segments.to(self.device))


@dataclass
class ParallelModel:
    """Everything a training step needs on this rank."""

    model_cfg: ModelConfig  # the model's shape (its plan's)
    mesh: Mesh
    dp: DataParallel
    loss_fn: LossFn
    device: torch.device
    runner: StepRunner
    plan: ModelPlan | None = None
    compiled: CompileReport | None = None  # what runs under torch.compile (train.compile)

    @property
    def module(self) -> nn.Module:
        return self.dp.module


def engine_policies(cfg: Config) -> tuple[ZeroConfig, MixedPrecision, AdamWConfig]:
    """The data-parallel engine's ZeRO, mixed-precision and optimizer policies."""
    param_dtype = parse_dtype(cfg.param_dtype_name, "precision.param_dtype")
    reduce_dtype = parse_dtype(cfg.reduce_dtype_name, "precision.reduce_dtype")
    master = torch.float64 if param_dtype == torch.float64 else torch.float32
    zero = ZeroConfig(stage=cfg.parallel.zero_stage, bucket_mb=cfg.parallel.bucket_mb,
                      prefetch=cfg.parallel.prefetch, keep_gathered=cfg.parallel.keep_gathered,
                      accumulation=cfg.parallel.accumulation)
    precision = MixedPrecision(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype,
        master_dtype=master if cfg.precision.master_weights else param_dtype)
    optim = AdamWConfig(lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2),
                        eps=cfg.train.eps, weight_decay=cfg.train.weight_decay)
    return zero, precision, optim


def check_layout(cfg: Config, model_cfg: ModelConfig, layout: Layout,
                 world_size: int | None = None) -> None:
    """Reject unsupported settings before any process waits on another: the engine's
    policies, then every rule of `partita.layout_rules.validate` at once."""
    _, precision, _ = engine_policies(cfg)  # constructing the policies validates them
    mode = CompilePolicy(cfg.train.compile).mode
    # Every layout compiles its blocks (what dynamo cannot trace runs as `EagerOnly`
    # pieces); only `model` refuses some.
    refusal = model_refusal(layout, model_cfg.moe) if mode == "model" else None
    if refusal:
        raise PartitaError(refusal)
    validate(layout, model_cfg, layout.world_size if world_size is None else world_size,
             seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch)
    if layout.offload.endswith("+disk"):
        policy = offload_policy(cfg, layout)
        # Checked before launch: a budget too small for one sub-group, and the
        # directory (exists, writable, room for this machine's ranks' files).
        shards = precision.param_dtype if policy.params else None  # in files too
        # The engine's rule: the gradients it updates from (the owned slice's dtype),
        # staged through the buffer sets only when they are on a GPU.
        grads = (precision.reduce if ZeroStage(layout.zero_stage).shards_gradients
                 else precision.grad_dtype)
        device = cfg.train.device
        on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        subgroup_elements(policy.budget_bytes, precision.master, grads, shards,
                          stage_grads=on_gpu)
        owned = -(-model_cfg.num_params() // (layout.zero_group if layout.zero_stage else 1))
        ranks = min(layout.world_size, torch.cuda.device_count() or layout.world_size)
        per_rank = disk_bytes_needed(owned, precision.master) + (
            owned * shards.itemsize if shards is not None else 0)
        check_offload_dir(policy.directory, ranks * per_rank)


def offload_policy(cfg: Config, layout: Layout) -> OffloadPolicy:
    """Where the layout's offloaded states go (the directory and budget of disk modes)."""
    return OffloadPolicy(layout.offload, cfg.parallel.offload_dir,
                         int(cfg.parallel.host_memory_budget_gb * 1e9))


@dataclass
class PipelineCut:
    """After the pipeline cut: the modules of this rank's pipeline stages."""

    module: nn.Module
    plan: ModelPlan
    pipeline: PipelineSetup | None  # None: no pipeline, the whole model


@dataclass
class ShardedModel:
    """After tensor parallelism: this rank's shards, and the loss that fits its logits."""

    module: nn.Module
    plan: ModelPlan
    pipeline: PipelineSetup | None
    loss_fn: LossFn
    tensor_parallel: TensorParallelReport | None  # None: tp = 1


def cut_pipeline(model: nn.Module, plan: ModelPlan,
                 pipeline: PipelineSetup | None) -> PipelineCut:
    """Step 1: keep only this rank's stages (see partita.pipeline.build)."""
    if pipeline is not None:
        pipeline.cut(model, plan)
    return PipelineCut(model, plan, pipeline)


def shard_tensor_parallel(staged: PipelineCut, comm: GroupComm, sequence_parallel: bool,
                          dropout_seed: int, moe_tp: str = "replicate") -> ShardedModel:
    """Step 2: swap the plan's modules for tensor-parallel ones over `comm` (tp > 1)."""
    if comm.size == 1 and not sequence_parallel:
        # The real vocabulary: logit columns of a padded one (model.vocab_multiple) past
        # it are no token, and the loss must give them no probability.
        shape = staged.plan.shape
        loss: LossFn = (cross_entropy if shape is None
                        else partial(cross_entropy, vocab_size=shape.vocab_size))
        return ShardedModel(staged.module, staged.plan, staged.pipeline, loss, None)
    report = apply_tensor_parallel(staged.module, staged.plan, comm,
                                   sequence_parallel=sequence_parallel,
                                   dropout_seed=dropout_seed, moe_tp=moe_tp)
    loss_fn: LossFn = report.loss_fn if report.loss_fn is not None else cross_entropy
    return ShardedModel(staged.module, staged.plan, staged.pipeline, loss_fn, report)


def shard_context_parallel(sharded: ShardedModel, comm: GroupComm, kind: str) -> None:
    """Step 2b (cp > 1): the plan's attention cores become ring or all-gather attention
    over `comm`; after tensor parallelism, so they see the local heads."""
    if comm.size > 1:
        apply_context_parallel(sharded.module, sharded.plan, comm, kind)


def recompute(sharded: ShardedModel, policy: RecomputePolicy) -> RecomputeReport:
    """Step 3: activation recomputation of this rank's blocks, as `policy` says."""
    return apply_recompute(sharded.module, sharded.plan, policy)


def wrap_data_parallel(sharded: ShardedModel, mesh: Mesh, zero: ZeroConfig,
                       precision: MixedPrecision, optim: AdamWConfig,
                       device: torch.device,
                       offload: OffloadPolicy | None = None) -> DataParallel:
    """Step 4: the data-parallel / ZeRO engine, which materialises the meta parameters.

    Values come from the plan's init rule by global name: the whole local tensor for
    ZeRO 0-2, only the owned flat slice for ZeRO-3, drawn in float32 exactly as a
    single-device build draws them, then cast.
    """
    model, plan, pipeline = sharded.module, sharded.plan, sharded.pipeline
    bucket_key = None
    if pipeline is not None:  # a tied head's copy of the embedding is not a parameter
        pipeline.detach_tied(model, plan)
        bucket_key = pipeline.bucket_key(model, plan)
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and plan.init is None:
        raise PartitaError(
            "the model is on the meta device but its plan has no init rule "
            "(ModelPlan.init), so no rank can draw its parameters. Give the plan a "
            "ParamInit, or build the model with its values on a real device."
        )
    init_fn = model_init_fn(plan.init) if on_meta else None
    return DataParallel(model, mesh, zero=zero, precision=precision, optim=optim,
                        blocks=plan.block_names(model), init_fn=init_fn, device=device,
                        bucket_key=bucket_key, offload=offload)


def make_runner(sharded: ShardedModel, dp: DataParallel, mesh: Mesh,
                device: torch.device) -> StepRunner:
    """Step 5: how a step's microbatches run on this rank."""
    runner: StepRunner
    if sharded.pipeline is not None:
        runner = sharded.pipeline.runner(dp, sharded.loss_fn, device, mesh, sharded.plan)
    else:
        runner = MicrobatchRunner(dp, sharded.loss_fn, device)
    if mesh.size("context") > 1:  # each rank keeps its chunks of every sequence
        return ContextParallelRunner(runner, mesh.comm("context"))
    return runner


def dropout_seed(seed: int, mesh: Mesh) -> int:
    """The seed of a rank's tensor-parallel dropout streams: different between replicas
    (they see different tokens) and between pipeline stages (each holds other layers,
    whose masks would otherwise repeat the first stage's, draw for draw), and the same
    on the tp ranks of one stage, which the replicated kind relies on."""
    replicas = mesh.size("loss_average")
    return seed + mesh.index("loss_average") + replicas * mesh.index("pipeline")


def start_from_first_rank(model: nn.Module, device: torch.device) -> None:
    """Every rank's copy of a model built with its values takes those of global rank 0,
    before tensor parallelism slices it or a pipeline cuts it: ranks seeded differently
    would otherwise hold replicated parameters (norms, row-parallel biases) that differ
    between tensor-parallel peers, matching no single-device model. Nothing is sent for
    a model on the meta device, whose values the plan's init rule draws alike anywhere.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for param in model.parameters():
            if param.is_meta:
                continue
            # The backend's device (NCCL sends only GPU tensors), then back in place.
            moved = param.detach().to(device)
            dist.broadcast(moved, src=0)
            if moved.data_ptr() != param.data_ptr():
                param.copy_(moved)


def parallelize(model: nn.Module, plan: ModelPlan, cfg: Config, mesh: Mesh,
                device: torch.device | str) -> ParallelModel:
    """This rank's part of `model` under the layout of `cfg` on `mesh`.

    `model` is a single-device model, normally built on the meta device (then
    `plan.init` draws its parameters), that follows its plan: the blocks in an
    index-keyed ModuleDict at `plan.blocks`; for a pipeline, `model.embed(tokens)`,
    `model.head(hidden)` and blocks that map hidden states to hidden states. A model
    built with its values starts from global rank 0's on every rank
    (`start_from_first_rank`). `plan.shape` describes its widths for the layout checks.
    `device`: a torch.device or its name. Raises PartitaError for a layout the model
    cannot take, on every rank alike, before any process waits.
    """
    if plan.shape is None:
        raise PartitaError(
            "the model's plan has no shape (ModelPlan.shape): partita needs the model's "
            "widths, depth and vocabulary to check a layout and to cut a pipeline."
        )
    device = torch.device(device)
    layout = cfg.layout(mesh.world_size)
    check_layout(cfg, plan.shape, layout, mesh.world_size)
    if layout.degrees != mesh.dims:
        raise PartitaError(f"the mesh was built for {mesh.dims} but the configuration "
                           f"asks for {layout.degrees}; build both from one Layout.")
    plan.block_container(model)  # every layout reads the blocks; refused alike on all ranks
    if layout.tp > 1:
        check_patterns_match(model, plan)  # on the whole model: a stage lacks the others'
    start_from_first_rank(model, device)
    zero, precision, optim = engine_policies(cfg)
    pipeline = prepare_pipeline(cfg, plan.shape, mesh, layout) if layout.pp > 1 else None
    staged = cut_pipeline(model, plan, pipeline)
    sharded = shard_tensor_parallel(staged, mesh.comm("tensor"), cfg.parallel.sequence_parallel,
                                    dropout_seed=dropout_seed(cfg.data.seed, mesh),
                                    moe_tp=layout.moe_tp)
    shard_context_parallel(sharded, mesh.comm("context"), cfg.parallel.cp_kind)
    moe_layers = apply_expert_parallel(sharded.module, plan, mesh.comm("expert"))
    mode, note = resolve_mode(CompilePolicy(cfg.train.compile), layout, device,
                              moe=plan.shape.moe)
    # Blocks compile before recomputation wraps them and the engine hooks them, so both
    # stay outside the compiled code (partita.compile).
    compiled = compile_blocks(sharded.module, plan) if mode == "blocks" else None
    recompute(sharded, RecomputePolicy(layout.recompute, layout.recompute_layers))
    dp = wrap_data_parallel(sharded, mesh, zero, precision, optim, device,
                            offload_policy(cfg, layout))
    if mode == "model":
        compiled = compile_model(dp.module)
    if dp.param_sync is not None and mode != "none":
        dp.param_sync.regroup(compiled_units(dp.module, plan, mode))
    if compiled is None:
        compiled = CompileReport("none")
    compiled.note = note
    runner = make_runner(sharded, dp, mesh, device)
    if moe_layers or plan.shape.moe:  # auxiliary losses scaled like the main loss
        runner = MoERunner(runner, dp.module, lambda: dp.loss_scale)
    return ParallelModel(model_cfg=plan.shape, mesh=mesh, dp=dp, loss_fn=sharded.loss_fn,
                         device=device, runner=runner, plan=plan, compiled=compiled)


def build_parallel_model(cfg: Config, mesh: Mesh, device: torch.device) -> ParallelModel:
    """`parallelize` partita's own Transformer, built on the meta device from `cfg`.

    With `model.init_from` (a Hugging Face Llama folder) the plan's init reads the
    folder's weights instead of drawing random ones: each rank reads only its slices.
    """
    model_cfg = cfg.model_config()
    with torch.device("meta"):
        model = Transformer(model_cfg)
    plan = model.plan()
    if not cfg.model.init_from:
        return parallelize(model, plan, cfg, mesh, device)
    weights = HFWeights(cfg.model.init_from, model_cfg)
    pm = parallelize(model, dataclasses.replace(plan, init=weights), cfg, mesh, device)
    weights.close()  # every parameter is materialised: unmap the files
    return pm
