"""Published large-scale training runs the planner's step time is validated against.

Each row: the model's shape, the hardware, the layout, the batch and the measured
throughput as the source reports it, with the source named. Where a source leaves a
setting out, the row says what is assumed (`assumed`); nothing here is fitted per row.

Measured figures are of three kinds, each compared with the planner's own:
  "hw_tflops"    achieved FLOP/s per GPU counting the recomputed forward (Megatron's
                 96 B s l h^2 (1 + s/6h + V/16lh) convention: full recompute);
  "model_tflops" model FLOP/s per GPU (6N + attention, no recompute), i.e. MFU x peak;
  "step_s"       seconds per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NARAYANAN = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU "
             "Clusters Using Megatron-LM (SC21), Table 1")
NARAYANAN_T2 = ("Narayanan et al. 2021 (SC21), Table 2: PTD-P vs ZeRO-3 without model "
                "parallelism, 175B GPT-3")
KORTHIKANTI = ("Korthikanti et al. 2022, Reducing Activation Recomputation in Large "
               "Transformer Models (MLSys 2023), Table 5 (end-to-end iteration time)")
MTNLG = ("Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG "
         "530B, system performance table (iteration time, TFLOP/s per GPU)")
BLOOM = ("BigScience 2022, BLOOM (arXiv 2211.05100) sec. 3.4, and the run's training "
         "README (bigscience-workshop/bigscience, train/tr11-176B-ml/README.md): 149.77 "
         "TFLOP/s per GPU, 104.70 s per iteration on 384 A100-80GB")
LLAMA3 = ("Dubey et al. 2024, The Llama 3 Herd of Models, Table 4 (405B on H100: "
          "TFLOPs/GPU)")


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    # model
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    flavour: str = "gpt2"  # gpt2: LayerNorm, GELU, learned positions; llama: SwiGLU, RMSNorm
    kv_heads: int | None = None
    ffn: int | None = None
    dropout: float = 0.1
    # hardware and layout
    gpu: str = "A100-80GB"
    gpus: int = 8
    tp: int = 1
    pp: int = 1
    cp: int = 1
    virtual_stages: int = 1
    microbatch: int = 1
    global_batch: int = 1  # sequences
    zero_stage: int = 0
    recompute: str = "full"
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    grad_bytes: int = 2  # bytes per gradient element reduced over data parallelism
    # Bytes per local parameter an unfused gradient accumulation moves after every
    # microbatch (Assumptions.grad_accum_bytes_per_param; 0: fused into the GEMM).
    grad_accum_bytes: float = 0.0
    attention: str = "eager"  # the kernel of the time: fused softmax (eager) or flash
    # Network port per GPU (bytes/s) where the cluster is not a DGX with one HDR NIC per
    # GPU (None: the catalog GPU's).
    inter_node_bandwidth: float | None = None
    # Pipeline sends and receives overlap no compute (Assumptions.pp_overlap = 0):
    # DeepSpeed's p2p is synchronous only (deepspeed/runtime/pipe/p2p.py asserts
    # async_op == False), and CUDA_LAUNCH_BLOCKING=1 does the same to any framework.
    blocking_p2p: bool = False
    # measurement
    kind: str = "hw_tflops"
    measured: float = 0.0
    assumed: tuple[str, ...] = field(default_factory=tuple)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)


_MB = ("microbatch size not stated in the table: 1",
       "pipeline schedule not stated: 1F1B without interleaving",
       "fp16 mixed precision (gradients reduced in fp16)")
# Megatron-LM of 2021-22 all-reduces gradients after the backward pass (overlapping it
# came later, --overlap-grad-reduce): in the training dtype under fp16 (SC21's runs),
# in fp32 under bf16 (--accumulate-allreduce-grads-in-fp32, required for bf16).
# Gradient accumulation: until Megatron-LM fused it into the weight-gradient GEMM
# (commit 83b1e42f, "gradient accumulation fusion", Feb 2022; on by default, with
# --no-gradient-accumulation-fusion to disable it), each microbatch's 16-bit gradients
# were added into the accumulation buffer by a separate pass: `main_grad.add_(grad)`
# (megatron/model/distributed.py, Mar 2021), or autograd's in-place `grad += new`,
# 16-bit + 16-bit -> 16-bit under fp16: 6 bytes per parameter. SC21 (Apr 2021) ran
# before the fusion, Korthikanti et al. (May 2022) after it.
_MEGATRON_2021 = dict(grad_bytes=2, overlap_grad_reduce=False, grad_accum_bytes=6)
_MEGATRON_2022 = dict(grad_bytes=4, overlap_grad_reduce=False)
# DeepSpeed ZeRO-3 of 2021: parameters gathered on demand around each module, the
# gradient reduce-scatter overlapping backward.
_ZERO3_2021 = dict(overlap_param_gather=False)


def _narayanan(name, layers, hidden, heads, tp, pp, gpus, batch, tflops) -> Run:
    return Run(name, NARAYANAN, layers, hidden, heads, 51200, 2048, gpus=gpus, tp=tp, pp=pp,
               global_batch=batch, measured=tflops, assumed=_MB, **_MEGATRON_2021)


RUNS: list[Run] = [
    _narayanan("gpt-1.7b", 24, 2304, 24, 1, 1, 32, 512, 137),
    _narayanan("gpt-3.6b", 30, 3072, 32, 2, 1, 64, 512, 138),
    _narayanan("gpt-7.5b", 36, 4096, 32, 4, 1, 128, 512, 142),
    _narayanan("gpt-18.4b", 40, 6144, 48, 8, 1, 256, 1024, 135),
    _narayanan("gpt-39.1b", 48, 8192, 64, 8, 2, 512, 1536, 138),
    _narayanan("gpt-76.1b", 60, 10240, 80, 8, 4, 1024, 1792, 140),
    _narayanan("gpt-145.6b", 80, 12288, 96, 8, 8, 1536, 2304, 148),
    _narayanan("gpt-310.1b", 96, 16384, 128, 8, 16, 1920, 2160, 155),
    _narayanan("gpt-529.6b", 105, 20480, 128, 8, 35, 2520, 2520, 163),
    _narayanan("gpt-1008b", 128, 25600, 160, 8, 64, 3072, 3072, 163),
    # Table 2: the same 175B model, two layouts on the same GPUs.
    Run("175b-ptdp-384", NARAYANAN_T2, 96, 12288, 96, 51200, 2048, gpus=384, tp=8, pp=12,
        global_batch=1536, measured=153, assumed=_MB[1:], **_MEGATRON_2021),
    Run("175b-zero3-384", NARAYANAN_T2, 96, 12288, 96, 51200, 2048, gpus=384, microbatch=4,
        global_batch=1536, zero_stage=3, measured=144, **_ZERO3_2021),
    Run("175b-ptdp-768", NARAYANAN_T2, 96, 12288, 96, 51200, 2048, gpus=768, tp=8, pp=12,
        global_batch=1536, measured=149, assumed=_MB[1:], **_MEGATRON_2021),
    Run("175b-zero3-768", NARAYANAN_T2, 96, 12288, 96, 51200, 2048, gpus=768, microbatch=2,
        global_batch=1536, zero_stage=3, measured=88, **_ZERO3_2021),
]

_K = dict(source=KORTHIKANTI, vocab=51200, seq=2048, kind="step_s", **_MEGATRON_2022,
          assumed=("pipeline schedule not stated: 1F1B without interleaving",))
for _name, _l, _h, _a, _pp, _gpus, _full, _sel in (
        ("22b", 48, 6144, 64, 1, 8, 1.42, 1.10), ("175b", 96, 12288, 96, 8, 64, 18.13, 13.75),
        ("530b", 105, 20480, 128, 35, 280, 49.05, 37.83),
        ("1t", 128, 25600, 160, 64, 512, 94.42, 71.49)):
    RUNS.append(Run(f"{_name}-full-recompute", layers=_l, hidden=_h, heads=_a, gpus=_gpus,
                    tp=8, pp=_pp, global_batch=4 if _pp == 1 else _gpus,
                    measured=_full, **_K))
    RUNS.append(Run(f"{_name}-selective-sp", layers=_l, hidden=_h, heads=_a, gpus=_gpus,
                    tp=8, pp=_pp, global_batch=4 if _pp == 1 else _gpus,
                    recompute="selective", sequence_parallel=True, measured=_sel, **_K))

# Megatron-DeepSpeed: DeepSpeed's pipeline engine reduces gradients (ReduceGrads) and
# takes the ZeRO-1 step, all-gather included, after the last microbatch of its schedule
# (deepspeed/runtime/pipe/schedule.py, TrainSchedule): neither overlaps compute. Its
# sends and receives are synchronous (deepspeed/runtime/pipe/p2p.py).
_DEEPSPEED = dict(overlap_grad_reduce=False, overlap_param_gather=False, blocking_p2p=True)
# MT-NLG trained in bf16 (the paper's hardware section, as bigscience-workshop/bigscience
# train/tr8-104B-wide/chronicles.md and jasperzhong/read-papers-and-code#261 report it):
# gradients accumulate and are reduced in fp32 under bf16 in both frameworks (Megatron-LM forces --accumulate-allreduce-grads-in-fp32 with
# --bf16; DeepSpeed's BF16_Optimizer keeps fp32 gradients), and no public code of 2021
# fused the accumulation into the GEMM. The code that trained MT-NLG is not public:
# the row takes the least any unfused fp32 accumulation of bf16 gradients moves, one
# mixed-dtype add (read 2 + 4, write 4 bytes: Megatron-LM's `main_grad.add_`);
# DeepSpeed's own bf16 pipeline path (2022) moves 18 (see BLOOM).
_MTNLG_ASSUMED = _MB[:1] + (
    "fp32 gradient accumulation of bf16 gradients as one unfused add per microbatch "
    "(10 bytes per parameter; the 2021 code is not public)",)
for _nodes, _secs in ((280, 60.1), (350, 50.2), (420, 44.4)):
    RUNS.append(Run(f"mt-nlg-530b-{_nodes}nodes", MTNLG, 105, 20480, 128, 51200, 2048,
                    gpus=8 * _nodes, tp=8, pp=35, global_batch=1920, zero_stage=1,
                    kind="step_s", measured=_secs, assumed=_MTNLG_ASSUMED, grad_bytes=4,
                    grad_accum_bytes=10, **_DEEPSPEED))

# BLOOM's run as its training README states it (bigscience-workshop/bigscience,
# train/tr11-176B-ml/README.md): Jean Zay's A100 nodes with 4 Omni-Path 100 Gb/s links
# per 8-GPU node, i.e. 50 Gb/s = 6.25 GB/s of network per GPU, a quarter of a DGX
# A100's; bf16 with DeepSpeed's BF16 optimizer, which accumulates (and reduces)
# gradients in fp32; DeepSpeed activation checkpointing (full recompute); dropout 0.1;
# CUDA_LAUNCH_BLOCKING=1 (set against a hang at 40+ nodes). 104.70 s per iteration,
# 149.77 TFLOP/s at GBS 2048 (the end of the first epoch, iteration 85376).
# The BF16_Optimizer's accumulation runs after every microbatch's backward
# (deepspeed/runtime/pipe/engine.py, _exec_backward_pass -> update_hp_grads, from the
# bf16 + pipeline commit 56c52238, Apr 2022): `hp_grad.add_(lp.grad.to(fp32))`, a cast
# (read 2, write 4 bytes per parameter) and an add (read 4 + 4, write 4): 18 bytes.
RUNS.append(Run("bloom-176b", BLOOM, 70, 14336, 112, 250880, 2048, gpus=384, tp=4, pp=12,
                microbatch=2, global_batch=2048, zero_stage=1, measured=149.77,
                grad_bytes=4, grad_accum_bytes=18, inter_node_bandwidth=6.25e9,
                **_DEEPSPEED))

_L3 = dict(source=LLAMA3, layers=126, hidden=16384, heads=128, vocab=128256,
           flavour="llama", kv_heads=8, ffn=53248, dropout=0.0, gpu="H100", tp=8, pp=16,
           zero_stage=1, recompute="none", sequence_parallel=True, attention="flash",
           kind="model_tflops", virtual_stages=4,
           assumed=("virtual stages not stated: 4", "ZeRO-1-like sharding (FSDP without "
                    "resharding parameters)", "no activation recomputation"))
RUNS += [
    Run("llama3-405b-8k-gpus", seq=8192, gpus=8192, global_batch=64 * 32, measured=430,
        **_L3),
    Run("llama3-405b-16k-gpus", seq=8192, gpus=16384, global_batch=128 * 16, measured=400,
        **_L3),
    Run("llama3-405b-131k-seq", seq=131072, gpus=16384, cp=16, global_batch=8 * 16,
        measured=380, **_L3),
]

# Pairs of rows measured on the same hardware whose order the planner must reproduce:
# (faster, slower).
ORDERINGS = [("175b-ptdp-384", "175b-zero3-384"), ("175b-ptdp-768", "175b-zero3-768")] + [
    (f"{m}-selective-sp", f"{m}-full-recompute") for m in ("22b", "175b", "530b", "1t")]
