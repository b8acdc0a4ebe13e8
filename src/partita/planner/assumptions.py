"""Every modelling assumption of the planner, named, documented and overridable.

Nothing in the memory or time model is a hidden constant: when a figure is not a
property of the model shape or the hardware datasheet, it is a field here. The CLI
overrides them with `--set name=value`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from partita.config_ranges import AT_LEAST_0, POSITIVE, Rule, number_range
from partita.errors import PartitaError, did_you_mean
from partita.models.attention_kernel import BF16_UNITS

# torch's CPU flash-attention kernel as a fraction of the rate the planner gives a GEMM
# with the head dimension as its inner dimension (the preset's `gemm_peak_fraction`
# included), forward and backward: 0.39-0.49 and 0.44-0.47 over (batch, heads, seq,
# head_dim) = (4, 4, 128, 32), (4, 8, 128, 64), (1, 8, 512, 64), one thread, on a quiet
# machine (`tools/cpu_step_model.py attention`, docs/planner.md).
CPU_FLASH = (0.42, 0.45)
# `partita_on_gpu()`'s attention rate, as a fraction of the GPU's GEMM rate. Fitted, not
# measured: it is the value the preset's H200 validation (tests/unit/test_planner_host.py,
# docs/planner.md) was checked with. Measured alone on that H200, torch's attention ran
# 1.5-1.9x faster than the GPU defaults' 0.7 / 0.55 (`tools/gemm_sweep.py`), yet with
# those defaults partita's predicted steps there fall 9-20% short of the measured ones:
# this slower attention stands in for work of partita's eager model that the byte and
# operation counts do not see, not yet found.
PARTITA_GPU_FLASH = (0.28, 0.28)


@dataclass(frozen=True)
class Assumptions:
    # --- compute -------------------------------------------------------------------
    # Kernel-level compute model (`partita.planner.compute`, docs/planner.md).
    # Fraction of datasheet peak large bf16 GEMMs sustain; 0: the GPU family's figure
    # in `compute.GEMM_PEAK_FRACTION` (A100 0.78, H100 0.68, H200 0.70, ...).
    gemm_peak_fraction: float = 0.0
    # Output tile edge of a GEMM kernel: dimensions are rounded up to whole tiles.
    gemm_tile: int = 128
    # Inner-dimension steps that a tile's prologue and epilogue cost: the rate of a
    # GEMM with inner dimension K is scaled by K / (K + gemm_k_half).
    gemm_k_half: float = 64.0
    # A GEMM whose n or k (a leading dimension of its operands) is not a multiple of
    # `gemm_align` elements cannot use the vectorised tensor-core kernels and runs at
    # `misaligned_gemm_fraction` of the rate (bf16 on an H200: N = 8191, 8193 or 8319
    # ran at 0.19-0.21 of N = 8256, tools/gemm_sweep.py). 0: no such effect (CPUs).
    gemm_align: int = 8
    misaligned_gemm_fraction: float = 0.2
    # Fixed cost of launching one kernel (CUDA launch, tail of the previous kernel).
    kernel_overhead_s: float = 4e-6
    # Fraction of datasheet memory bandwidth streaming kernels reach.
    memory_efficiency: float = 0.8
    # Flash attention's rate as a fraction of the GEMM rate at its head dimension
    # (FlashAttention-2 reports ~70% of GEMM speed forward, less backward).
    flash_fwd_fraction: float = 0.7
    flash_bwd_fraction: float = 0.55
    # Eager attention: bytes moved per score element by softmax (+ dropout) forward
    # and backward (bf16 scores, probabilities, a byte of dropout mask).
    eager_softmax_bytes_fwd: float = 9.0
    eager_softmax_bytes_bwd: float = 11.0
    # Bytes per element of the activations elementwise kernels read and write.
    activation_elem_bytes: float = 2.0
    # Memory-bound kernels per block forward (norms, activation, residual adds).
    elementwise_kernels: int = 8
    # Host seconds per eager operation of partita's model on a GPU machine (dispatch,
    # autograd, allocation, launch; views counted as operations too): a floor under each
    # microbatch and the optimizer step (`compute.host_times`). 0: not modelled (other
    # implementations' operations are not counted). partita_on_gpu() sets the figure
    # measured on an H200's host (docs/planner.md, "The host's floor").
    host_op_s: float = 0.0
    # Count the bytes partita's eager elementwise operations move (`planner.eager_ops`,
    # counted on the model: 3-6x the fused kernels' bytes) instead of fused kernels'.
    eager_elementwise: bool = False
    # Bytes the loss moves per logit (fp32 softmax forward and its gradient).
    loss_bytes_per_logit: float = 16.0
    # Bytes per local parameter that an unfused gradient accumulation moves after every
    # microbatch's backward, adding that microbatch's 16-bit weight gradients into the
    # accumulation buffer (docs/planner.md, "Gradient accumulation between
    # microbatches"). 0: the weight-gradient GEMM accumulates in place (Megatron-LM's
    # gradient-accumulation fusion, 2022 on), or the pass is left out. Megatron-LM 2021
    # `main_grad.add_(grad)`: 6 into a 16-bit buffer, 10 into fp32 (bf16); DeepSpeed's
    # BF16_Optimizer `update_hp_grads`, a cast to fp32 then an add: 18.
    grad_accum_bytes_per_param: float = 0.0
    # Bytes a fused Adam step moves per local parameter: fp32 master, two moments
    # (read + write), the gradient read, the 16-bit parameter written.
    optimizer_bytes_per_param: float = 32.0
    # Attention kernel: "flash" keeps no s x s score matrix (only a log-sum-exp per
    # row); "eager" saves softmax output (and dropout mask and output when dropout > 0);
    # "model": what partita's model picks per call on `device_type` under its
    # `model.attention` (`partita.models.attention_kernel`; its explicit scores keep the
    # softmax output alone: its attention has no dropout).
    attention_kernel: str = "flash"
    # "cpu" or "cuda": the device partita's model runs on, where its choices depend on it.
    device_type: str = "cuda"
    # That CPU's bf16 instructions, "none", "avx512" (AVX-512 BF16) or "amx": "auto"
    # attention takes explicit scores only with them, up to a limit that depends on
    # which (`models.attention_kernel`).
    cpu_bf16_units: str = "avx512"
    # Tensors of width h a norm saves: 1 with a fused kernel (its input), 2 in eager
    # PyTorch (input and normalised output, for the weight's gradient).
    norm_saved_tensors: int = 1
    # Tensors of width f a SwiGLU MLP saves: 3 fused (gate, up, fc2 input), 4 eager.
    swiglu_saved_tensors: int = 3

    # --- communication ---------------------------------------------------------------
    # Fraction of link bandwidth a collective reaches (NCCL bus bandwidth over the
    # per-direction datasheet figure; nccl-tests report ~0.75-0.85 on NVLink and IB).
    intra_node_efficiency: float = 0.8
    inter_node_efficiency: float = 0.8
    # Overlap: the fraction of the compute a mechanism runs beside that can hide its
    # communication (hidden = min(comm, overlap * compute)).
    # With `Layout.tp_comm_overlap` (Megatron's --tp-comm-overlap): TP collectives are
    # cut into chunks that run beside the GEMMs next to them; without it they sit on
    # the critical path (this fraction is then not used).
    tp_overlap: float = 0.9
    # ... and the GEMMs running beside those chunks lose this fraction of their speed
    # for as long as they share the GPU's SMs with the communication kernels.
    tp_overlap_slowdown: float = 0.05
    cp_overlap: float = 0.9  # ring attention sends the next KV block while computing
    # Context-parallel attention as partita runs it: eager pieces in the compute dtype
    # (>= float32; no s x s scores kept, the merged output kept in that dtype) and key/
    # value gradients that accumulate and travel in it (planner.context_parallel).
    cp_eager_pieces: bool = False
    # ... whose pieces run a fused flash kernel (torch's CPU one) rather than explicit
    # scores: then a rank's attention costs what one process's costs, divided by c.
    cp_fused_pieces: bool = False
    pp_overlap: float = 0.5  # p2p of one microbatch overlaps the next one's compute
    # The compute model describes partita's eager kernels (on a CPU, or on a GPU with
    # `partita_on_gpu`), which `train.compile` fuses (`planner.compiled`): compiling gains
    # them. The fused kernels of the GPU default are assumed to gain nothing.
    compile_gain: bool = False
    # Set for a compiled run (`planner.compiled`, any preset): a compiled block's backward
    # is one node, so a zero-bubble split computes its weight gradients in I and holds
    # them, parameter-sized, until W (`pipeline.backward.runs_whole`).
    compiled_blocks: bool = False
    # ... whose selectively recomputed attention core keeps the generator state the
    # compiler reruns its kernel from (the kernel takes a dropout argument): a CUDA
    # generator's seed and offset, or a CPU generator's whole state (`measured_cpu`).
    generator_state_bytes: float = 16.0
    # Set for `train.compile=model` on a model whose blocks compile fused
    # (`planner.compiled`): the final norm compiles with the rest (its input and rsqrt
    # kept, the normalised output recomputed), each block saves its own rotary tables,
    # and a fully recomputed block reruns inside the compiled backward (from a saved
    # generator state), whose working memory is not counted, as for every operation the
    # compiler recomputes.
    compiled_model: bool = False
    # Without sequence parallelism, tp ranks hold the same stage output: Megatron-LM
    # sends 1/tp of it each and all-gathers it over NVLink on arrival (Narayanan et al.
    # 2021, sec. 4.1, "scatter/gather"); DeepSpeed's engine partitions it likewise.
    pp_scatter_gather: bool = True
    ep_overlap: float = 0.0  # dispatch/combine all-to-all waits for the router
    # With `Layout.overlap_grad_reduce`: gradient buckets reduce while backward continues.
    dp_overlap: float = 0.8
    # With `Layout.overlap_param_gather`: ZeRO-3's prefetched all-gathers run beside the
    # previous block; ZeRO-1/2's after-step all-gather beside the next forward.
    zero3_overlap: float = 0.8
    # ZeRO-2/3 shard gradients, so with gradient accumulation they reduce-scatter after
    # every microbatch (a full local copy would defeat the sharding); ZeRO-0/1 reduce
    # once per step.
    sharded_grads_reduce_every_microbatch: bool = True
    # Latency steps of one collective over n ranks: 2*log2(n) (tree/recursive halving).
    tree_latency: bool = True

    # --- memory ----------------------------------------------------------------------
    # Allocator fragmentation and caching slack, as a fraction of everything else.
    fragmentation: float = 0.10
    # Gradient bucket bytes in flight during data-parallel reduction (two buckets;
    # never more than the gradients themselves).
    grad_bucket_bytes: float = 2 * 50e6
    # ZeRO-3: blocks gathered ahead of the one computing.
    zero3_prefetch_depth: int = 1
    # Logits on the last stage: bf16 logits plus an fp32 copy for the softmax of the
    # cross-entropy and its gradient, per vocabulary entry per token.
    logits_bytes_per_element: float = 10.0

    # --- partita's own implementation (see `measured_cpu`) -------------------------------
    # The defaults above describe fused GPU kernels and Megatron's accounting. These
    # fields describe what partita's eager model and engines really hold; their defaults
    # leave the GPU figures unchanged and `measured_cpu()` turns them on.
    # Norms: "fused" saves `norm_saved_tensors` tensors of width h; "eager" is partita's
    # model: RMSNorm saves an fp32 copy of its input, its normalised output and an fp32
    # rsqrt per token; LayerNorm (torch's kernel) its input and fp32 mean and rstd;
    # "compiled" (RMSNorm inside a block `train.compile` fuses): its input and the rsqrt.
    norm_kernel: str = "fused"
    # partita's attention on CUDA repeats grouped kv heads to the query heads before the
    # kernel, which then saves full-width K and V (kernels with native GQA keep the kv
    # heads, as torch's CPU flash kernel does for partita on CPU).
    gqa_expanded_kv: bool = False
    # tp above the kv heads: partita keeps every kv head's K and V projections on each
    # rank (Megatron keeps only the head its query heads read).
    whole_kv_replicas: bool = False
    # Count the tensor-parallel collectives outside the layers (embedding, head, loss,
    # gradients of tp-replicated parameters); the textbook count has 4 per layer only.
    tp_boundary_comm: bool = False
    # ZeRO-3 keeps the root group (embeddings, final norm, head) gathered from the end
    # of forward until its gradients are in: 3 Psi - Psi_root per step, not 3 Psi.
    zero3_keeps_root: bool = False
    # ... and the last this many gather units (with their experts' units), which
    # backward needs first (partita's `parallel.keep_gathered`, 1 by default).
    zero3_kept_units: int = 0
    # Eager rotary embedding saves its cos and sin tables (seq x head_dim/2 each, per
    # layer); a fused rope kernel recomputes them.
    rotary_tables_saved: bool = False
    # Under sequence parallelism partita's column-parallel layers keep the all-gathered
    # (full-sequence) input for backward; Megatron saves the shard and gathers it again.
    sp_saves_gathered_input: bool = False
    # Count what partita's loss holds only while it runs, beyond what it saves
    # (`loss_transient_bytes`): the logits beside its saved fp32 tensor in forward,
    # their gradient in backward. The fused default counts the loss in
    # `logits_bytes_per_element` alone.
    loss_transients: bool = False
    # Bytes per token a loss saves besides its targets: partita's keeps an fp32 row sum
    # of exponentials and two boolean masks (6).
    loss_token_bytes: float = 0.0
    # Bytes per token of integer ids kept for backward (embedding lookup, loss targets);
    # negligible at scale, a visible share of a tiny model's activations.
    token_id_bytes: float = 0.0
    # ZeRO flat buffers: 0 = the ZeRO paper's unpadded accounting; > 0 = partita's flat
    # buffers, each padded to a multiple of (ZeRO group x this many elements). Stage 3
    # has one buffer per gather unit (consecutive blocks up to `zero_bucket_bytes`) plus
    # one for the rest; stages 0-2 one per gradient bucket of `zero_bucket_bytes` (the
    # engine's bucket_mb default, 25 MiB).
    flat_buffer_align: int = 0
    zero_bucket_bytes: float = 25 * 2**20

    # --- offload ---------------------------------------------------------------------
    # Adam update rate of the host CPU, parameters per second per GPU's share of cores.
    cpu_adam_params_per_s: float = 1.0e9
    offload_overlap: float = 0.0  # the CPU step runs after backward, before next forward
    # Disk offload: read + write bandwidth of one GPU's share of its node's disks, and
    # the host memory its engine may buffer through (parallel.host_memory_budget_gb).
    disk_bandwidth: float = 1.0e9
    disk_host_budget_bytes: float = 1.0e9

    def __post_init__(self) -> None:
        if self.attention_kernel not in ("flash", "eager", "model"):
            raise PartitaError(
                f"attention_kernel={self.attention_kernel!r}: use 'flash', 'eager' or "
                "'model'."
            )
        if self.cpu_bf16_units not in BF16_UNITS:
            raise PartitaError(f"cpu_bf16_units={self.cpu_bf16_units!r}: use "
                               f"{', '.join(repr(u) for u in BF16_UNITS)}.")
        if self.device_type not in ("cuda", "cpu"):  # what the model's kernel rules read
            raise PartitaError(f"device_type={self.device_type!r}: use 'cuda' or 'cpu'.")
        if self.norm_kernel not in ("fused", "eager", "compiled"):
            raise PartitaError(f"norm_kernel={self.norm_kernel!r}: use 'fused', 'eager' or "
                               "'compiled'.")
        for name, kind, rule in _CHECKS:
            value = getattr(self, name)
            if kind is bool:
                if not isinstance(value, bool):
                    raise PartitaError(f"assumption {name}={value!r}: use true or false.")
                continue
            # bool is an int subclass: True must not pass for a count or a rate.
            if isinstance(value, bool) or not isinstance(value, int if kind is int
                                                          else int | float):
                what = "an integer" if kind is int else "a number"
                raise PartitaError(f"assumption {name}={value!r} is not {what}; give "
                                   f"{what} {rule.text}.")
            if not rule.ok(value):
                raise PartitaError(f"assumption {name}={value!r} is out of range: use "
                                   f"{rule.text}{_WHY.get(name, '')}.")

    @classmethod
    def measured_cpu(cls) -> Assumptions:
        """What partita itself does, as measured on CPU (eager PyTorch, gloo): the
        preset for the `cpu` device profile, checked by tests/dist/test_planner_accuracy.py.

        torch's CPU scaled-dot-product attention is a flash-style kernel (it saves Q, K,
        V, the output and an fp32 log-sum-exp, no s x s scores) that reads grouped kv
        heads in place (K and V keep the kv heads' width); short bf16 sequences take
        explicit scores instead (`attention_kernel="model"`), which keep the bf16
        softmax output and no log-sum-exp, and whose bias add and softmax move 8 bytes
        per score forward and 6 backward; everything else eager:
        SwiGLU keeps gate, silu(gate), up and their product; the loss (`partita.loss`)
        keeps one fp32 element per vocabulary entry, and while it runs the logits or
        their gradient beside it (`loss_transients`). `partita_on_gpu()` is the same
        with the GPU kernel constants.

        Kernels: the profile's peak is itself a measured matmul rate (the best of
        repeated products on warm caches) and its bandwidth a measured copy. Inside a
        training step the GEMMs reach 0.86 of that rate (2026-12-05, a quiet machine: the
        tiny model at 4x128 tokens, 2.52 GFLOP of `aten::mm` in 28.3 ms, and llama-20m,
        47.5 GFLOP in 533 ms, both 89 GFLOP/s against 103 alone), which
        `gemm_peak_fraction` 0.88 gives with the short-K factor at these shapes; a
        1-thread fp32 sweep here (M = N = 512) ran at full rate down to K = 16 and at
        58% at K = 8 (k_half ~ 8), with no tile steps at N = 96-256 (docs/planner.md).
        torch's CPU flash kernel runs at `CPU_FLASH` of the GEMM rate. Elementwise work
        is what partita's eager operations move (`eager_elementwise`), and there is no
        fixed cost per kernel: the profile's `eager_op_s` (3.5-12 us here) prices every
        eager operation the model runs (`planner.eager_ops`), the GEMMs' among them.
        """
        return cls(attention_kernel="model", device_type="cpu",
                   eager_softmax_bytes_fwd=8.0, eager_softmax_bytes_bwd=6.0,
                   norm_kernel="eager", swiglu_saved_tensors=4,
                   logits_bytes_per_element=4.0, gqa_expanded_kv=False,
                   rotary_tables_saved=True, sp_saves_gathered_input=True,
                   whole_kv_replicas=True, tp_boundary_comm=True, zero3_keeps_root=True,
                   zero3_kept_units=1, generator_state_bytes=5056.0,
                   token_id_bytes=16.0, flat_buffer_align=64, loss_transients=True,
                   loss_token_bytes=6.0, gemm_peak_fraction=0.88, gemm_tile=0, gemm_align=0,
                   gemm_k_half=8.0, kernel_overhead_s=0.0, memory_efficiency=1.0,
                   cp_eager_pieces=True, cp_fused_pieces=True, pp_scatter_gather=False,
                   compile_gain=True, eager_elementwise=True,
                   flash_fwd_fraction=CPU_FLASH[0], flash_bwd_fraction=CPU_FLASH[1])

    @classmethod
    def partita_on_gpu(cls) -> Assumptions:
        """partita's own model and engines (`measured_cpu()`'s memory accounting) on a
        GPU: the preset of `partita plan --implementation partita`. There, grouped kv
        heads are repeated before the attention kernel (`models.transformer.AttentionCore`).
        Compiling gains here as on a CPU (`compile_gain`), checked on one H200 (Llama 3.2
        1B, bf16, docs/planner.md): compiled/eager step time predicted 0.86 at 4 x 2048
        tokens and 0.85 at 8 x 2048, measured 0.81-0.84 and 0.85."""
        gpu = cls()
        kernels = {f: getattr(gpu, f) for f in KERNEL_FIELDS}
        kernels.update(flash_fwd_fraction=PARTITA_GPU_FLASH[0],
                       flash_bwd_fraction=PARTITA_GPU_FLASH[1])
        return replace(cls.measured_cpu(), device_type="cuda", compile_gain=True,
                       gqa_expanded_kv=True,
                       host_op_s=HOST_OP_S, generator_state_bytes=gpu.generator_state_bytes,
                       **kernels)

    @classmethod
    def for_device(cls, name: str) -> Assumptions:
        """Defaults for a device profile: `measured_cpu()` for `cpu`, else GPU defaults."""
        return cls.measured_cpu() if name.lower() == "cpu" else cls()

    def override(self, settings: dict[str, str]) -> Assumptions:
        """A copy with `name=value` strings (from `--set`) applied."""
        known = {f.name: f for f in fields(self)}
        changes: dict[str, object] = {}
        for name, raw in settings.items():
            if name not in known:
                raise PartitaError(
                    f"unknown assumption '{name}'.{did_you_mean(name, known)} "
                    f"Assumptions: {', '.join(known)}."
                )
            changes[name] = _parse_setting(name, raw, getattr(self, name))
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Host seconds per eager operation on a GPU machine, from one H200's host (torch 2.11,
# 2026-12-04, `partita bench gpu` at 1 x 128 tokens, where the GPU's work is negligible):
# gpt2-124m's 1,699 operations a step (planner.eager_ops: 1,633 in forward and backward,
# 66 in clipping and the update) in 31-42 ms, median 37.5 (22 us each); llama3.2-1b's
# 3,923 + 576 in 91.4 ms (20 us).
HOST_OP_S = 21e-6

# The fields that describe a device's kernels rather than what an implementation stores.
KERNEL_FIELDS = ("gemm_peak_fraction", "gemm_tile", "gemm_k_half", "gemm_align",
                 "misaligned_gemm_fraction", "kernel_overhead_s",
                 "memory_efficiency", "cp_fused_pieces", "flash_fwd_fraction",
                 "flash_bwd_fraction")

# The valid values of every numeric assumption. Rates, efficiencies and sizes that
# divide are > 0 (0 would divide by zero); byte counts, times and counts >= 0 (0 turns
# the effect off); fractions of a whole within [0, 1].
_FRACTION = number_range(0, 1)  # [0, 1]
_RATE_FRACTION = number_range(0, 1, lo_open=True)  # (0, 1]: a divisor
RANGES: dict[str, Rule] = {
    "gemm_peak_fraction": _FRACTION,  # 0: the GPU family's figure
    "gemm_tile": AT_LEAST_0,
    "gemm_k_half": AT_LEAST_0,
    "gemm_align": AT_LEAST_0,
    "misaligned_gemm_fraction": _RATE_FRACTION,
    "kernel_overhead_s": AT_LEAST_0,
    "memory_efficiency": _RATE_FRACTION,
    "flash_fwd_fraction": _RATE_FRACTION,
    "flash_bwd_fraction": _RATE_FRACTION,
    "eager_softmax_bytes_fwd": AT_LEAST_0,
    "eager_softmax_bytes_bwd": AT_LEAST_0,
    "activation_elem_bytes": AT_LEAST_0,
    "elementwise_kernels": AT_LEAST_0,
    "host_op_s": AT_LEAST_0,
    "loss_bytes_per_logit": AT_LEAST_0,
    "grad_accum_bytes_per_param": AT_LEAST_0,
    "optimizer_bytes_per_param": AT_LEAST_0,
    "norm_saved_tensors": AT_LEAST_0,
    "swiglu_saved_tensors": AT_LEAST_0,
    "generator_state_bytes": AT_LEAST_0,
    "intra_node_efficiency": _RATE_FRACTION,
    "inter_node_efficiency": _RATE_FRACTION,
    "tp_overlap": _FRACTION,
    "tp_overlap_slowdown": _FRACTION,
    "cp_overlap": _FRACTION,
    "pp_overlap": _FRACTION,
    "ep_overlap": _FRACTION,
    "dp_overlap": _FRACTION,
    "zero3_overlap": _FRACTION,
    "fragmentation": _FRACTION,
    "grad_bucket_bytes": AT_LEAST_0,
    "zero3_prefetch_depth": AT_LEAST_0,
    "logits_bytes_per_element": AT_LEAST_0,
    "zero3_kept_units": AT_LEAST_0,
    "loss_token_bytes": AT_LEAST_0,
    "token_id_bytes": AT_LEAST_0,
    "flat_buffer_align": AT_LEAST_0,
    "zero_bucket_bytes": POSITIVE,
    "cpu_adam_params_per_s": POSITIVE,
    "offload_overlap": _FRACTION,
    "disk_bandwidth": POSITIVE,
    "disk_host_budget_bytes": POSITIVE,
}
_WHY = {name: " (it divides: 0 would mean infinite time)" for name in (
    "misaligned_gemm_fraction", "memory_efficiency", "flash_fwd_fraction",
    "flash_bwd_fraction", "intra_node_efficiency", "inter_node_efficiency",
    "cpu_adam_params_per_s", "disk_bandwidth")}
_BOOL = Rule(lambda v: isinstance(v, bool), "true or false")
# (name, type, rule) of every field but the two named kernels, checked in that order;
# built once, as every `replace` of the assumptions runs the checks again.
_CHECKS: tuple[tuple[str, type, Rule], ...] = tuple(
    (f.name, {"bool": bool, "int": int, "float": float}[f.type],
     _BOOL if f.type == "bool" else RANGES[f.name])
    for f in fields(Assumptions) if f.type != "str")


def _parse_setting(name: str, raw: str, current: object) -> object:
    """A `--set` value read as the field's type: booleans and integers strictly, so that
    a typo is refused rather than read as false or truncated."""
    text = raw.strip()
    if isinstance(current, bool):
        word = text.lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise PartitaError(f"assumption {name}={raw!r} is not true or false; write "
                           f"--set {name}=true or --set {name}=false.")
    if isinstance(current, str):
        return text
    rule = RANGES[name]
    try:
        number = float(text)
    except ValueError:
        raise PartitaError(f"assumption {name}={raw!r} is not a number; give a number "
                           f"{rule.text}, e.g. --set {name}={current}.") from None
    if isinstance(current, int):
        if not number.is_integer():
            raise PartitaError(f"assumption {name}={raw!r} is not an integer; give a whole "
                               f"number {rule.text}, e.g. --set {name}={current}.")
        return int(number)
    return number


DEFAULT_ASSUMPTIONS = Assumptions()  # immutable, shared as a default argument
