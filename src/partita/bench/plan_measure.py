"""One layout, predicted by the planner and measured on partita itself, side by side.

A `Case` is a layout the test suite runs on CPU (data / tensor / sequence parallel, ZeRO
stage, fp32 or bf16 with fp32 master weights). `measure_cases` runs on every rank of a
gloo world: it builds the model as a real run does (`build_parallel_model`: meta model,
tensor parallel, ZeRO engine), then takes one training step and reads

- model states: the ZeRO engine's memory ledger (bytes of the live tensors);
- activations: distinct non-parameter storages autograd saved during the forward and
  the loss (`partita.saved_tensors.SavedTensorMeter`);
- communication: bytes this rank sent, from the mesh's counter, by purpose;
- step time: the median of timed trainer steps (`runner.train`, clip, step).

`predict` asks the planner the same questions from shapes alone, with the assumptions
that describe partita on CPU (`Assumptions.measured_cpu`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from partita.planner import Assumptions, Layout, PlanModel, Precision
from partita.planner.compiled import compiled_activations
from partita.planner.hardware import Cluster, GPUSpec
from partita.planner.memory import (
    activation_bytes,
    disk_state_bytes,
    host_state_bytes,
    model_state_bytes,
)
from partita.planner.timing import step_time

STATE_TERMS = ("parameters", "gradients", "master_weights", "optimizer_states")
DISK_BUDGET_GB = 0.001  # disk-offload cases' default: a host budget far below their states
# Mesh purposes whose bytes the planner predicts, and the planner's name for each.
# Expert parameters reduce (and, under ZeRO, gather) over their own group: data-parallel
# bytes too. "expert" counts the all-to-alls (rows and their split sizes).
COMM = {"tensor": "tp_bytes", "zero_shard": "dp_bytes", "pipeline": "pp_bytes",
        "context": "cp_bytes", "expert": "ep_bytes", "expert_grad_reduce": "dp_bytes"}
COMM_NAMES = tuple(dict.fromkeys(COMM.values()))


@dataclass(frozen=True)
class Shape:
    """The model and batch every case trains (small: the suite runs on two cores)."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = 2
    vocab_size: int = 256
    seq_len: int = 32
    flavour: str = "llama"
    tie_embeddings: bool = False
    # Mixture of experts (0: dense): SwiGLU experts, top_k, every moe_every-th block.
    n_experts: int = 0
    top_k: int = 2
    moe_every: int = 1


@dataclass(frozen=True)
class Case:
    dp: int = 1
    tp: int = 1
    zero: int = 0
    sp: bool = False
    dtype: str = "float32"  # or "bfloat16": bf16 parameters, fp32 master weights
    # precision.reduce_dtype ("" = dtype): "float32" under bf16 holds gradients in fp32.
    reduce: str = ""
    mb: int = 2  # sequences per microbatch
    pp: int = 1  # pipeline stages
    microbatches: int = 1  # per rank and step
    schedule: str = "1f1b"  # 1f1b, gpipe, zb-h1, interleaved-1f1b
    vpp: int = 1  # virtual stages per rank (interleaved)
    shape: Shape = Shape()
    recompute: str = "none"  # activation recomputation: none, selective, full
    recompute_layers: int = 0  # recompute only the first K blocks of each stage
    offload: str = "none"  # model states in host memory: none, optimizer, optimizer+params
    # Disk offload's host budget (parallel.host_memory_budget_gb): the default binds; one
    # above the engine's buffer sets for the largest bucket does not.
    host_budget_gb: float = DISK_BUDGET_GB
    cp: int = 1  # context-parallel degree (each sequence split over cp ranks)
    cp_kind: str = "ring"  # ring or allgather
    ep: int = 1  # expert-parallel degree (carved from dp x cp); routing forced balanced
    moe_tp: str = "replicate"  # MoE blocks under tp: replicated, "experts" or "hidden" split
    compile: str = "none"  # train.compile: none, blocks or model

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp, zero_stage=self.zero,
                      microbatch_size=self.mb, sequence_parallel=self.sp,
                      schedule=self.schedule, virtual_stages=self.vpp,
                      recompute=self.recompute, recompute_layers=self.recompute_layers,
                      offload=self.offload, cp=self.cp, cp_kind=self.cp_kind, ep=self.ep,
                      moe_tp=self.moe_tp)

    @property
    def precision(self) -> Precision:
        if self.dtype == "float32":
            return Precision.fp32()
        return Precision.named("bf16-fp32-grads" if self.reduce == "float32" else "bf16")

    @property
    def label(self) -> str:
        parts = [f"dp{self.dp}"] + ([f"tp{self.tp}" + ("sp" if self.sp else "")]
                                    if self.tp > 1 else [])
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + ("ag" if self.cp_kind == "allgather" else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.moe_tp != "replicate":
            parts[-1] += {"experts": "et", "hidden": "ht"}[self.moe_tp]  # split over tp
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f" {self.schedule}" if self.schedule != "1f1b" else ""))
        parts[-1] += f" m{self.microbatches}" if self.microbatches > 1 else ""
        kind = "" if self.shape.flavour == "llama" else f" {self.shape.flavour}"
        if self.shape.n_experts:
            s = self.shape
            kind += f" moe{s.n_experts}k{s.top_k}" + (f"/{s.moe_every}" if s.moe_every > 1 else "")
        if self.offload != "none":
            kind += f" off-{self.offload}"
            if self.offload.endswith("+disk") and self.host_budget_gb != DISK_BUDGET_GB:
                kind += f"@{self.host_budget_gb:g}GB"
        if self.compile != "none":
            kind += f" compiled-{self.compile}"
        if self.recompute != "none":
            kind += f" rc-{self.recompute}" + (f"{self.recompute_layers}"
                                               if self.recompute_layers else "")
        if self.reduce and self.reduce != self.dtype:
            kind += f" reduce-{'fp32' if self.reduce == 'float32' else self.reduce}"
        return f"{'x'.join(parts)} z{self.zero} {'bf16' if self.dtype != 'float32' else 'fp32'}{kind}"


def run_config(case: Case, offload_dir: str = ""):
    """The run configuration a user would write for this case; `offload_dir` is where a
    disk-offload case keeps its files (the caller owns the folder)."""
    from partita.config import Config

    s, cfg = case.shape, Config()
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "flavour",
                 "tie_embeddings", "n_experts", "top_k", "moe_every"):
        setattr(cfg.model, name, getattr(s, name))
    cfg.model.max_seq_len = s.seq_len
    cfg.data.seq_len = s.seq_len
    cfg.train.global_batch = case.dp * case.mb * case.microbatches
    cfg.train.microbatches = case.microbatches
    cfg.train.dtype = case.dtype
    cfg.precision.reduce_dtype = case.reduce
    cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp = case.dp, case.tp, case.pp
    cfg.parallel.schedule = case.schedule
    cfg.parallel.virtual_stages = case.vpp
    cfg.parallel.zero_stage = case.zero
    cfg.parallel.sequence_parallel = case.sp
    cfg.parallel.recompute = case.recompute
    cfg.parallel.recompute_layers = case.recompute_layers
    cfg.parallel.offload = case.offload
    cfg.parallel.cp, cfg.parallel.cp_kind = case.cp, case.cp_kind
    cfg.parallel.ep, cfg.parallel.moe_tp = case.ep, case.moe_tp
    cfg.train.compile = case.compile
    if case.offload.endswith("+disk"):
        cfg.parallel.offload_dir = offload_dir
        cfg.parallel.host_memory_budget_gb = case.host_budget_gb
    return cfg


def plan_model(case: Case) -> PlanModel:
    return PlanModel("plan-accuracy", run_config(case).model_config())


def predict(case: Case, gpu: GPUSpec | None = None, assumptions: Assumptions | None = None,
            stage: int = 0) -> dict[str, float]:
    """The planner's figures for one GPU (rank) of pipeline stage `stage` of `case`;
    step time and communication need `gpu`."""
    model, layout, prec = plan_model(case), case.layout, case.precision
    if assumptions is None:  # this machine's: its CPU's bf16 units decide the attention
        from partita.models.transformer import cpu_bf16_units

        assumptions = replace(Assumptions.measured_cpu(), cpu_bf16_units=cpu_bf16_units())
    a = compiled_activations(assumptions, model, case.compile)
    seq, m = case.shape.seq_len, case.microbatches
    out = dict(model_state_bytes(model, layout, prec, stage, a))
    out["model_states"] = sum(out[t] for t in STATE_TERMS)
    if case.offload.endswith("+disk"):
        a = replace(a, disk_host_budget_bytes=case.host_budget_gb * 1e9)
    out["host_model_states"] = host_state_bytes(model, layout, prec, stage, a)
    out["disk_bytes"] = disk_state_bytes(model, layout, prec, stage, a)
    out["activations"] = activation_bytes(model, layout, seq, m, stage, prec, a)
    if gpu is not None:
        cluster = Cluster(gpu, case.world, max(case.world, gpu.gpus_per_node))
        t = step_time(model, layout, cluster, seq, case.dp * case.mb * m, prec, a,
                      compile=case.compile)
        out.update({k: t[k] for k in (*COMM_NAMES, "step_s")})
    return out


def measure_link(rank: int, world: int, reps: int = 10,
                 big_bytes: int = 1 << 22) -> tuple[float, float]:
    """(seconds per latency step, bytes/s) of gloo all-reduce in this world, now.

    Timed like the planner models a collective: a tiny all-reduce costs 2 log2(n)
    latency steps; a `big_bytes` one moves 2(n-1)/n of its bytes per rank on top of
    that. Medians of `reps`, every rank starting together.
    """
    import math

    def timed(t: torch.Tensor) -> float:
        samples = []
        for _ in range(reps + 1):  # + a warm-up
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[1:])

    if world == 1:
        return 0.0, float("inf")
    small = timed(torch.zeros(2))
    big = timed(torch.zeros(big_bytes // 4))
    sent = 2 * (world - 1) / world * big_bytes
    return small / (2 * math.log2(world)), sent / max(big - small, 1e-9)


def measure_in_this_process(cases: list[Case]) -> list[dict]:
    """`measure_cases` of one-rank cases in this process, on one thread as every rank of
    a measured world runs (the caller's thread count restored after)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_cases(0, 1, cases)
    finally:
        torch.set_num_threads(threads)


def measure_cases(rank: int, world: int, cases: list[Case], timed_steps: int = 0) -> list[dict]:
    """Run on every rank of a gloo world of `world` ranks; one dict per case."""
    from partita.mesh import Mesh
    from partita.parallelize import dims_from_config

    meshes: dict = {}  # process groups are slow to create: one mesh per layout shape
    out = []
    for case in cases:
        dims = dims_from_config(run_config(case), world).degrees
        if dims not in meshes:
            meshes[dims] = Mesh(dims, rank, world)
        # A disk-offload case's files go to a folder of its own, removed after it.
        folder = (tempfile.TemporaryDirectory(prefix="partita-plan-", ignore_cleanup_errors=True)
                  if case.offload.endswith("+disk") else nullcontext(""))
        with folder as offload_dir:
            out.append(_measure(meshes[dims], case, timed_steps, offload_dir))
    return out


def _measure(mesh, case: Case, timed_steps: int, offload_dir: str) -> dict:
    from partita.parallelize import build_parallel_model
    from partita.saved_tensors import SavedTensorMeter

    cfg = run_config(case, offload_dir)
    pm = build_parallel_model(cfg, mesh, torch.device("cpu"))
    _balance_routing(pm.module)
    dp, seq, m = pm.dp, case.shape.seq_len, case.microbatches
    gen = torch.Generator().manual_seed(17 + mesh.index("data"))  # cp ranks: same rows
    tokens = torch.randint(case.shape.vocab_size, (case.mb * m, seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]

    mesh.counter.reset()
    # The trainer's own microbatch loop (or pipeline schedule); the peak is what is
    # held for backward at once (a pipeline stage holds several microbatches; a zero-
    # bubble one also the gradients kept for its deferred weight passes).
    with SavedTensorMeter(pm.module,
                          lambda: getattr(pm.runner, "deferred_bytes", 0)) as meter:
        pm.runner.train(x, y, m)
    _finish_step(dp)
    out = {k: v for k, v in dp.memory_ledger().items() if k in STATE_TERMS}
    out["model_states"] = sum(out[t] for t in STATE_TERMS)
    out["host_model_states"] = dp.memory_ledger()["host_model_states"]
    out["disk_bytes"] = dp.memory_ledger().get("disk_bytes", 0)
    out["activations"] = meter.peak_bytes
    out["stage"] = mesh.coord.pp
    for name in COMM_NAMES:
        out[name] = sum(mesh.counter.total(p) for p, n in COMM.items() if n == name)

    times = []
    for _ in range(timed_steps + (1 if timed_steps else 0)):  # + one warm-up step
        if dist.is_initialized():
            dist.barrier()  # every rank starts the step together
        start = time.perf_counter()
        pm.runner.train(x, y, m)
        _finish_step(dp)
        times.append(time.perf_counter() - start)
    if times:
        out["step_s"] = statistics.median(times[1:])
    dp.close()  # its hooks would keep its buffers alive through the cases that follow
    return out


def _balanced_route(n: int, k: int, e: int) -> torch.Tensor:
    return torch.arange(n * k).view(n, k) % e


def _balance_routing(module) -> None:
    """Choice j of token i to expert (i*k + j) mod E: the planner counts balanced
    routing (each expert top_k/E of the tokens), so the measurement forces it."""
    from partita.models.moe import moe_modules

    for _, moe in moe_modules(module):
        moe.forced_route = _balanced_route


def _finish_step(dp) -> None:
    dp.finish_grad_sync()
    dp.clip_grad_norm_(1.0)
    dp.step()
    # Under host offload the update and the stage 1-2 parameter gathers it queues run
    # into the next forward; the figures are one whole step's, so wait for them here.
    dp.wait_params()
    dp.zero_grad()


def worst_rank(results: list[dict]) -> dict:
    """Per figure, the largest over ranks: the planner predicts the fullest GPU."""
    return {k: max(r[k] for r in results) for k in results[0]}


def worst_by_stage(results: list[dict]) -> dict[int, dict]:
    """`worst_rank` over the ranks of each pipeline stage."""
    stages = sorted({r["stage"] for r in results})
    return {s: worst_rank([r for r in results if r["stage"] == s]) for s in stages}


def rel_error(predicted: float, measured: float) -> float:
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return abs(predicted - measured) / measured
