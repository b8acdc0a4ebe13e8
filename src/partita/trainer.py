"""The training loop: one process per rank, the same code on a laptop and a cluster.

Loss semantics: the reported loss is the mean next-token cross-entropy over every token
of the global batch. Each rank takes the mean over its own tokens, each microbatch's
loss is divided by the number of microbatches, and gradients are averaged over the
data-parallel replicas, so gradients equal those of the global-batch mean loss.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from partita.checkpoint import CheckpointWriter, Loaded, load_checkpoint
from partita.checkpoint.resume import checkpoint_root, restart_target
from partita.compile import compile_summary
from partita.config import Config
from partita.data import TokenDataset
from partita.data.dataset import load_configured
from partita.data.sampler import IGNORE_INDEX, eval_batch_size, eval_batches
from partita.device_specs import slow_cpu_matmul_warning
from partita.errors import (
    STOP_REQUEST,
    AgreedError,
    PartitaError,
    PeerFailure,
    PeerReported,
)
from partita.experts import moe_step_stats
from partita.faults import PIPELINE_POINTS, FaultPlan, Faults
from partita.host_memory import keep_freed_host_memory
from partita.launch import LauncherWatch, launcher_pid, mark_this_worker_finished
from partita.machine_cache import default_cache_dir
from partita.mesh import Mesh
from partita.metrics import MetricsLogger, StepWindow, device_peak_flops, memory_bytes
from partita.models.documents import document_ids
from partita.models.model_config import vocab_alignment_warning
from partita.optim import WarmupCosine
from partita.parallelize import ParallelModel, build_parallel_model, dims_from_config
from partita.process_setup import default_threads, init_distributed, pick_device
from partita.trainer_checkpoints import CheckpointSteps
from partita.trainer_failures import told_failure
from partita.watchdog import Progress, SilentAtTheEnd
from partita.weights import save_weights


@contextlib.contextmanager
def evaluation_mode(module: nn.Module) -> Iterator[None]:
    """Every submodule of `module` in eval mode (dropout draws no mask, so evaluation
    neither adds noise to the loss nor advances the dropout generators that training
    and checkpoints rely on), then each back to the mode it had."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    stepped: bool
    moe: dict = field(default_factory=dict)  # MoE figures (experts.moe_step_stats)
    loss_scale: float | None = None  # fp16 loss scaling: the scale the step ran with


def open_dataset(cfg: Config) -> TokenDataset:
    """The run's dataset, tokenized into the cache on first use."""
    d = cfg.data
    cache = d.cache_dir or str(default_cache_dir())
    data = load_configured(d, cache)
    model_vocab = cfg.model_config().vocab_size
    if data.vocab_size > model_vocab:
        what = f"tokenizer '{d.tokenizer}'" if d.tokenizer else "the data"
        # An imported model's vocabulary is its weights' and cannot be set.
        fix = ("use the model's own tokenizer (the one in model.init_from's folder)"
               if cfg.model.init_from else
               f"set --model.vocab_size={data.vocab_size} or use a tokenizer that fits the "
               "model")
        raise PartitaError(
            f"{what} uses {data.vocab_size} token ids but the model's vocabulary has "
            f"{model_vocab}; {fix}.")
    return data


# A stall is reported only after at least this long, however short the median step.
STALL_MIN_SECONDS = 2.0


class Trainer(CheckpointSteps):
    def __init__(self, cfg: Config, fault: FaultPlan | None = None) -> None:
        self.cfg = cfg
        self.device = pick_device(cfg.train.device)
        if self.device.type == "cpu":
            keep_freed_host_memory()  # per-step buffers without page faults, see module
        rank, world = init_distributed(self.device, cfg.train.collective_timeout_s)
        dims = dims_from_config(cfg, world)
        self.mesh = Mesh(dims, rank, world, cfg.train.collective_timeout_s)
        # Where this rank is (step, phase), for the watchdog and for error messages.
        self.progress = Progress(rank, world, cfg.train.stall_warning_factor,
                                 STALL_MIN_SECONDS, cfg.train.collective_timeout_s)
        self.launcher = LauncherWatch(launcher_pid())
        torch.manual_seed(cfg.data.seed + rank)
        # Python's and numpy's generators are saved in checkpoints too: seeded, two runs
        # of one configuration write the same checkpoint files byte for byte.
        random.seed(cfg.data.seed + rank)
        np.random.seed((cfg.data.seed + rank) % 2**32)
        self.out_dir = Path(cfg.train.out_dir)
        self.is_logger = rank == 0
        self.data = self._load_data()
        self.pm: ParallelModel = build_parallel_model(cfg, self.mesh, self.device)
        self.faults = Faults(fault, rank)
        self._arm_backward_fault()
        self._arm_transfer_fault()
        # Rows by replica; context-parallel ranks of a replica split every sequence
        # (the runner keeps their chunks), so they read the same rows.
        dp_size, dp_index = self.mesh.size("data"), self.mesh.index("data")
        self.sampler = self.data.train_sampler(cfg.train.global_batch, dp_index, dp_size,
                                               cfg.data.seed)
        self.bad_steps = 0
        self._reported = -1  # the step of the last save reported in the log
        self.checkpoint_waited = 0.0  # seconds training waited for checkpoint copies
        self.progress.enter(0, "checkpoint load")
        self.resumed: Loaded | None = self._resume(restart_target(cfg, rank))
        self.writer = CheckpointWriter(
            checkpoint_root(cfg), rank, world, cfg.train.keep_last, cfg.train.async_checkpoint,
            cfg.train.collective_timeout_s, self.resumed.folder if self.resumed else None,
            before_write=lambda step: self.faults.reach("checkpoint_write", step))
        STOP_REQUEST.install()  # SIGTERM: finish the step, checkpoint, exit
        self.logger = MetricsLogger(self.out_dir, self.is_logger, cfg.train.steps,
                                    cfg.train.progress, cfg.metrics.tensorboard,
                                    resume_at=self.resumed.step if self.resumed else None)
        self.run_id = self._start_run_id()
        self.peak = device_peak_flops(self.device, cfg.metrics.peak_tflops, cfg.param_dtype_name)
        self.loss_comm = self.mesh.comm("loss_average")
        # Windows per evaluation batch (the global batch); 0: nothing to validate on.
        self.eval_batch = 0 if cfg.train.eval_batches == 0 else eval_batch_size(
            len(self.data.val), cfg.train.global_batch)

    def _resume(self, folder: Path | None) -> Loaded | None:
        """Load the checkpoint in `folder` (None: a fresh run) with the data position."""
        if folder is None:
            return None
        loaded = load_checkpoint(self.pm, folder, self.cfg.data.seed)
        training = loaded.training
        if "sampler" in training:
            self.sampler.load_state_dict(training["sampler"])
        self.bad_steps = int(training.get("bad_steps", 0))
        return loaded

    def _load_data(self) -> TokenDataset:
        # One process per node tokenizes; the others then open the finished cache.
        if self.mesh.world_size > 1 and int(os.environ.get("LOCAL_RANK", 0)) != 0:
            dist.barrier()
            return open_dataset(self.cfg)
        data = open_dataset(self.cfg)
        if self.mesh.world_size > 1:
            dist.barrier()
        return data

    # One optimizer step ------------------------------------------------------------------
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, lr: float,
                   step: int = 0) -> StepResult:
        dp = self.pm.dp
        self._enter(step, "forward and backward", "forward")
        local = self.pm.runner.train(inputs, targets, self.cfg.train.microbatches,
                                     self._segments(inputs), self._targets_per_rank(targets))
        self._enter(step, "gradient reduction", "reduction")
        dp.finish_grad_sync()
        self._enter(step, "clipping")
        grad_norm = dp.clip_grad_norm_(self.cfg.train.grad_clip or None)
        self._enter(step, "loss average")
        mean_loss = self._mean_loss(local)
        moe = moe_step_stats(self.pm.module, self.mesh)  # {} for a dense model
        # Every rank sees the same loss and norm, so all skip or all step together. An
        # infinite norm under fp16 loss scaling is an overflow the engine itself skips.
        healthy = math.isfinite(mean_loss) and (
            math.isfinite(grad_norm) or dp.precision.loss_scaling)
        self._enter(step, "optimizer step", "optimizer")
        # An asynchronous checkpoint copies the state beside this step's forward and
        # backward; the optimizer step is the first thing that changes it.
        self.checkpoint_waited += self.writer.wait_for_copy()
        scale = dp.loss_scale if dp.precision.loss_scaling else None  # before an overflow halves it
        stepped = dp.step(lr) if healthy else False
        dp.zero_grad()
        return StepResult(mean_loss, grad_norm, stepped, moe, scale)

    def _enter(self, step: int, phase: str, fault_point: str | None = None) -> None:
        """Record where this rank is (for the watchdog and error messages); fire an
        injected fault planned for this point."""
        self.progress.enter(step, phase)
        self.launcher.check()
        if fault_point is not None:
            self.faults.reach(fault_point, step)

    def _arm_transfer_fault(self) -> None:
        """A planned pipeline send/receive fault fires when the runner posts one."""
        plan, transport = self.faults.plan, getattr(self.pm.runner, "transport", None)
        if plan is None or plan.at not in PIPELINE_POINTS or transport is None:
            return
        wanted = "is_send" if plan.at == "pipeline_send" else "is_recv"

        def armed(post):
            def faulty(posted):
                if any(getattr(a.kind, wanted) for a, _ in posted):
                    self.faults.reach(plan.at, self.progress.step)
                return post(posted)
            return faulty
        transport.post = armed(transport.post)
        transport.post_recvs = armed(transport.post_recvs)

    def _arm_backward_fault(self) -> None:
        """A planned backward fault fires inside autograd, at the first block's backward."""
        plan = self.faults.plan
        if plan is None or plan.at != "backward":
            return
        blocks = [m for n, m in self.pm.module.named_modules() if n.count(".") == 1
                  and n.startswith("blocks.")]
        target = blocks[0] if blocks else self.pm.module
        target.register_full_backward_pre_hook(
            lambda *_: self.faults.reach("backward", self.progress.step))

    def _segments(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """Documents of the packed rows, when the data marks them and the run masks them."""
        end = self.data.boundary if self.cfg.data.document_mask else None
        return None if end is None else document_ids(inputs, end)

    def _targets_per_rank(self, targets: torch.Tensor) -> float | None:
        """With documents marked some targets are not trained, unevenly over ranks: the
        step's trained targets per loss-averaging rank, so the loss is their mean at any
        layout (partita.loss.microbatch_weight). Context-parallel peers hold the same
        rows, so the count is summed over the data-parallel group only."""
        if self.data.boundary is None:
            return None
        trained = int((targets != IGNORE_INDEX).sum())
        (total,) = self.mesh.comm("data").all_reduce_scalars([trained])
        return total / self.loss_comm.size

    def _mean_loss(self, local: float) -> float:
        """Average over replicas; with a pipeline only the last stage has a loss."""
        (total,) = self.loss_comm.all_reduce_scalars([local])
        if self.mesh.dims.pp > 1:
            (total,) = self.mesh.comm("pipeline").all_reduce_scalars([total])
        return total / self.loss_comm.size

    def evaluate(self) -> float | None:
        """The validation loss: mean cross-entropy over every counted target of the
        evaluated windows (`data.sampler.eval_batches`: the same windows at every
        layout), with the model in eval mode (no dropout). None: nothing to validate."""
        c = self.cfg
        if self.eval_batch == 0:
            return None

        # A pipeline splits a batch into train.microbatches when they divide its rows,
        # else runs it whole, which interleaved schedules cannot: a short last batch's
        # rows are padded to a multiple of them.
        multiple = c.train.microbatches if self.mesh.dims.pp > 1 else 1

        def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            return eval_batches(self.data.val, self.data.seq_len, self.eval_batch,
                                self.mesh.index("data"), self.mesh.size("data"),
                                c.train.eval_batches, self.data.boundary, multiple)

        # Every batch is weighted by its counted targets over those of all batches (a
        # first pass over the tokens alone), so the sum over batches and ranks is the
        # mean over all counted targets: batches of unequal counts (packed documents,
        # a short last batch, padding rows) are not averaged as equals.
        counted = sum(int((y != IGNORE_INDEX).sum()) for _, y in batches())
        (total,) = self.mesh.comm("data").all_reduce_scalars([counted])
        if total == 0:
            return None
        per_rank = total / self.loss_comm.size
        with evaluation_mode(self.pm.module):
            local = sum(self.pm.runner.evaluate(x, y, self._segments(x), per_rank)
                        for x, y in batches())
        return self._mean_loss(local)

    # The loop ----------------------------------------------------------------------------
    def run(self) -> dict:
        c = self.cfg
        first = self.resumed.step if self.resumed else 0
        if self.is_logger:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            c.save(self.out_dir / "config.toml")
            self.logger.message(
                f"partita: {self.pm.model_cfg.num_params() / 1e6:.2f}M parameters "
                f"({self.pm.model_cfg.shape_text()}), "
                f"layout {self.mesh.dims}, {self.mesh.world_size} process(es) on {self.device.type}, "
                f"{self.data.num_tokens:,} tokens from {self.data.path.name}"
            )
            if self.resumed:
                # Same degrees and world size restore each rank's random streams; the
                # ZeRO stage, schedule or precision may still differ.
                how = ("same degrees: random streams restored" if self.resumed.same_layout
                       else "resharded into this layout: random streams reseeded")
                self.logger.message(f"resumed from {self.resumed.folder} at step {first} "
                                    f"({how})")
            if self.pm.compiled is not None and self.pm.compiled.note:
                self.logger.message(self.pm.compiled.note)
            # A misaligned output head costs GPUs ~5x on its GEMMs; CPUs not measurably.
            vocab_warning = (vocab_alignment_warning(self.pm.model_cfg, self.mesh.size("tensor"))
                             if self.device.type == "cuda" else None)
            if vocab_warning:
                self.logger.message(vocab_warning)
            half = c.param_dtype_name
            if self.device.type == "cpu" and half in ("bfloat16", "float16"):
                warning = slow_cpu_matmul_warning(half)
                if warning:
                    self.logger.message(warning)
        # Linear warm-up to train.lr, then cosine decay towards train.min_lr, which it
        # would reach at step train.steps: the last step run (train.steps - 1) is one
        # short of it and trains slightly above min_lr (optim.WarmupCosine).
        schedule = WarmupCosine(lr=c.train.lr, min_lr=c.train.min_lr,
                                warmup_steps=c.train.warmup_steps, total_steps=c.train.steps)
        tokens_per_step = c.train.global_batch * c.data.seq_len
        flops_per_step = self.pm.model_cfg.flops_per_token(c.data.seq_len) * tokens_per_step
        val_loss, result, stopped = None, None, False
        start = time.perf_counter()
        window = StepWindow(tokens_per_step, flops_per_step, self.peak * self.mesh.world_size)
        steady_s = 0.0  # training steps after the first: no warm-up, evaluation or saving

        def log(step: int) -> None:
            tps, mfu = window.take()
            record = {
                "loss": result.loss, "val_loss": val_loss, "lr": lr,
                "grad_norm": result.grad_norm, "tokens_per_s": tps, "mfu": mfu,
                "memory_gb": memory_bytes(self.device) / 1e9, **result.moe,
            }
            if not result.stepped:  # an fp16 overflow, or a bad step tolerated
                record["skipped"] = True  # (train.max_bad_steps): weights unchanged
            if result.loss_scale is not None:
                record["loss_scale"] = result.loss_scale
            self.logger.log(step + 1, record, console=True)

        for step in range(first, c.train.steps):
            step_start = time.perf_counter()
            inputs, targets = next(self.sampler)
            lr = schedule(step)
            result = self.train_step(inputs, targets, lr, step + 1)
            step_s = time.perf_counter() - step_start
            window.add(step_s)
            if step > first:  # the first step also warms up (allocator, compiling)
                steady_s += step_s
            if step == first and self.is_logger and self.pm.compiled is not None \
                    and self.pm.compiled.mode != "none":  # once: what compiled, what broke
                self.logger.message(compile_summary(self.pm.compiled))
            if not self._healthy(result):
                self.bad_steps += 1
                if self.bad_steps > c.train.max_bad_steps:
                    self._fail(step, result)
            last = step == c.train.steps - 1
            if (step + 1) % c.train.eval_every == 0 or last:
                self._enter(step + 1, "evaluation")
                val_loss = self.evaluate()
                if val_loss is not None and not math.isfinite(val_loss):
                    self._fail(step, StepResult(val_loss, result.grad_norm, False), "validation ")
            # A step that evaluated is logged too: its validation loss belongs to it,
            # not to the next logged step (eval_every need not be a multiple of log_every).
            logged = ((step + 1) % c.train.log_every == 0 or last or step == first
                      or val_loss is not None)
            if logged:
                log(step)
                val_loss = None if not last else val_loss
            stopped = self._checkpoint_after(step + 1, last)
            if stopped:
                if not logged:  # the step a run stops at ends its record, and resumes
                    log(step)
                break
        self._enter(c.train.steps, "checkpoint write")
        self._finish_saves()
        elapsed = time.perf_counter() - start
        done = step + 1 if result is not None else first
        summary = {
            "steps": done, "train_loss": result.loss if result else float("nan"),
            "val_loss": val_loss,
            "tokens_per_s": tokens_per_step * (done - first) / max(elapsed, 1e-9),
            # The training steps alone after the first, which short runs are dominated
            # by (evaluations and checkpoint writes left out as well).
            "tokens_per_s_after_first": (tokens_per_step * (done - first - 1)
                                         / max(steady_s, 1e-9)
                                         if done - first > 1 else None),
            "stopped": stopped, "checkpoint": str(self.writer.last.folder)
            if self.writer.last and self.writer.last.folder else "",
        }
        if stopped:  # the launcher says where the checkpoint is and how to continue
            self.logger.close()
            return summary
        self._enter(c.train.steps, "weight write", "weight_write")
        save_weights(self.pm, self.out_dir / "model.safetensors")
        if c.train.export and self.is_logger:
            from partita.export import export_run

            self._enter(c.train.steps, "export", "export")
            export_run(self.out_dir, self.out_dir / c.train.export, c.train.export,
                       overwrite=True)  # this run owns out_dir (checked at launch)
        if c.train.timeline_png and hasattr(self.pm.runner, "save_timeline"):
            self.pm.runner.save_timeline(c.train.timeline_png,
                                         f"{c.parallel.schedule}, last step, {self.mesh.dims}")
        if self.is_logger and not c.train.checkpoint_dir:
            # The default checkpoint folder is made at launch, since a SIGTERM would save
            # there; a run that finished without saving leaves no empty folder behind.
            with contextlib.suppress(OSError):  # not empty (or gone): left as it is
                checkpoint_root(c).rmdir()
        if self.is_logger:
            val = "n/a" if val_loss is None else f"{val_loss:.4f}"
            if result is None:
                # The last line still starts with "done:" (the README's promise, which
                # scripts read): a restart after the last step's checkpoint ends here.
                self.logger.message(f"done: the checkpoint is at step {first}, which "
                                    f"train.steps={c.train.steps} already reaches; nothing "
                                    "to train, the weights are written. Raise train.steps "
                                    "to train further.")
            else:
                steady = summary["tokens_per_s_after_first"]
                after = (f" ({steady:,.0f} in the training steps after the first)"
                         if steady else "")
                steps = summary["steps"]
                self.logger.message(
                    f"done: {steps} step{'s' if steps != 1 else ''}, train loss "
                    f"{summary['train_loss']:.4f}, val loss {val}, "
                    f"{summary['tokens_per_s']:,.0f} tokens/s{after}")
        self.logger.close()
        return summary

    def _healthy(self, result: StepResult) -> bool:
        if not math.isfinite(result.loss):
            return False
        return math.isfinite(result.grad_norm) or self.pm.dp.precision.loss_scaling

    def _fail(self, step: int, result: StepResult, what: str = "") -> None:
        self.logger.log(step + 1, {"status": "failed", "loss": result.loss,
                                   "grad_norm": result.grad_norm}, console=False)
        self.logger.close()
        value = (f"the {what}loss became {result.loss}" if not math.isfinite(result.loss)
                 else f"the gradient norm became {result.grad_norm}")
        raise AgreedError(
            f"{value} at step {step + 1}; training stopped and no weights "
            "were written. Common fixes: a lower train.lr, a longer train.warmup_steps, "
            "gradient clipping (train.grad_clip=1.0), or float32/bfloat16 instead of "
            "float16. To tolerate a few bad steps set train.max_bad_steps."
        )


def train(cfg: Config, fault: FaultPlan | None = None) -> dict:
    """Run training on this process (its rank comes from the environment)."""
    torch.set_num_threads(cfg.train.threads or default_threads())
    trainer = None
    launcher = launcher_pid()
    try:
        trainer = Trainer(cfg, fault)
        result = trainer.run()
        if mark_this_worker_finished():
            # partita's launcher watches the workers left on its node once one has
            # finished; this process watches the other nodes' (in a job of one process
            # per node, the last one's node has no finished worker).
            trainer.progress.wait_for_the_others(other_hosts_only=True)
        else:  # under torchrun or srun nothing else bounds the job's tail
            trainer.progress.wait_for_the_others()
        return result
    except (PeerReported, SilentAtTheEnd):  # told already, or by another process
        raise
    except (PeerFailure, RuntimeError, dist.DistError) as exc:
        told = told_failure(exc, trainer and trainer.progress, trainer and trainer.device,
                            launcher, cfg.train.collective_timeout_s)
        if told is exc:
            raise
        raise told from None
    finally:
        if trainer is not None:
            trainer.progress.close()
        if dist.is_initialized():
            dist.destroy_process_group()
