"""Text, JSON and picture forms of planner results."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from partita.config import layout_overrides
from partita.errors import PartitaError
from partita.models.model_config import aligned_vocab_multiple
from partita.planner.compiled import overlaps_in_effect
from partita.planner.compute import family_gemm_fraction, misaligned
from partita.planner.evaluate import MEMORY, UNAVAILABLE, Evaluation, Request, layout_text
from partita.planner.search import SearchResult
from partita.planner.stage_params import vocab_rows

# (column title, memory term) in the order a GPU's memory is usually explained.
MEMORY_COLUMNS = (
    ("params", "parameters"), ("grads", "gradients"), ("master", "master_weights"),
    ("optim", "optimizer_states"), ("activ", "activations"), ("buffers", "comm_buffers"),
    ("loss", "loss_transients"), ("reserve", "runtime_reserved"), ("frag", "fragmentation"),
    ("total", "total"),
)
KIND_TITLES = {"memory": "does not fit", "divisibility": "divisibility",
               "constraint": "constraint", "not available yet": "not available yet"}


def describe_request(req: Request) -> str:
    c, cl = req.model.config, req.cluster
    n = req.model.total_params()
    count = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.3g} M"
    moe = req.model.moe
    experts = (f", {moe.num_experts} experts of ffn {req.model.expert_ffn}, top-{moe.top_k}"
               if req.model.is_moe else "")
    # Every shape figure the prediction reads, filled-in ones (ffn, flavour, tie) too.
    tie = "tied" if c.tie_embeddings else "untied"
    dropout = f", dropout {c.dropout:g}" if c.dropout else ""
    biases = ", q/k/v biases" if c.qkv_bias else ""
    return (f"{req.model.name}: {count} parameters "
            f"({c.n_layers} layers, dim {c.dim}, ffn {c.ffn_hidden}, {c.n_heads} heads, "
            f"{c.kv_heads} kv heads, vocab {c.vocab_size}, {c.flavour} flavour{biases}, "
            f"{tie} embeddings{dropout}{experts})"
            f" on {cl.num_gpus} x {cl.gpu.name} ({cl.gpus_per_node} per node, "
            f"{cl.gpu.memory_bytes / 1e9:.0f} GB each); seq {req.seq_len}, global batch "
            f"{req.global_batch} sequences ({_tokens(req.global_batch * req.seq_len)}); "
            f"precision {req.precision.name}")


def model_shape(req: Request) -> dict:
    """Every shape figure the prediction reads (filled-in ones too), for --json."""
    m, c = req.model, req.model.config
    experts = ({"num_experts": m.moe.num_experts, "top_k": m.moe.top_k,
                "expert_ffn": m.expert_ffn, "moe_every": c.moe_every,
                "shared_experts": c.shared_experts} if m.is_moe else None)
    return {"layers": c.n_layers, "hidden": c.dim, "ffn": c.ffn_hidden, "heads": c.n_heads,
            "kv_heads": c.kv_heads, "vocab": c.vocab_size,
            "padded_vocab": c.padded_vocab_size, "seq": c.max_seq_len,
            "flavour": c.flavour, "qkv_bias": c.qkv_bias, "tie": c.tie_embeddings,
            "dropout": c.dropout, "experts": experts}


def mfu_peak(req: Request) -> float:
    """The peak FLOP/s MFU and HFU are over: the GPU's rate at the run's parameter
    width (`GPUSpec.for_dtype_bytes`)."""
    return req.cluster.gpu.for_dtype_bytes(req.precision.param).peak_flops


def mfu_peak_note(req: Request) -> str:
    """Which peak MFU is over, where it is not the 16-bit tensor peak; "" where it is."""
    gpu = req.cluster.gpu
    peak, tensor = mfu_peak(req), gpu.for_dtype_bytes(2).peak_flops
    if req.precision.param == 2 or peak == tensor:
        return ""
    return (f"MFU and HFU are over {gpu.name}'s fp32 peak, {_tflops(peak)} TFLOP/s (fp32 "
            f"matmuls do not run on the 16-bit tensor cores), not its 16-bit peak of "
            f"{_tflops(tensor)} TFLOP/s.")


def _tokens(n: int) -> str:
    """A token count in millions where that shows it, else in full (a CPU plan's batch)."""
    return f"{n / 1e6:.2f} M tokens" if n >= 1e6 else f"{n:,} tokens"


def format_table(evals: list[Evaluation]) -> str:
    """One row per layout: memory terms in GB on its peak stage, then time figures."""
    layouts = [layout_text(e.layout) for e in evals]
    scale, unit = _unit(max(e.memory.get("total", 0.0) for e in evals))
    width = max([len("layout")] + [len(s) for s in layouts])
    head = (f"{'#':>3}  {'layout':<{width}}  "
            + " ".join(f"{t:>7}" for t, _ in MEMORY_COLUMNS)
            + f"  {'step s':>8} {'tokens/s':>10} {'MFU':>5} {'HFU':>5} {'TFLOP/s':>7} "
            f"{'bubble':>6} {'comm s':>7}")
    lines = [f"{'':>{width + 5}}  per-GPU memory in {unit} (peak pipeline stage)", head,
             "-" * len(head)]
    for i, (e, name) in enumerate(zip(evals, layouts), 1):
        mem = " ".join(f"{e.memory.get(k, 0.0) / scale:>7.2f}" for _, k in MEMORY_COLUMNS)
        t = e.time
        lines.append(f"{i:>3}  {name:<{width}}  {mem}  {t['step_s']:>8.3f} "
                     f"{t['tokens_per_s']:>10.4g} {t['mfu']:>5.1%} {t['hfu']:>5.1%} "
                     f"{_tflops(t['model_flops_per_gpu']):>7} "
                     f"{t['bubble_fraction']:>6.1%} {t['comm_exposed_s']:>7.3f}")
    lines.append("MFU: model FLOPs (6N + attention, no recompute) over peak; HFU: hardware "
                 "FLOPs (recomputed forward included) over peak; TFLOP/s: model FLOP/s per GPU.")
    return "\n".join(lines)


def overlap_text(layout, compile: str = "none") -> str:
    """Which communication overlaps the prediction assumed, under the compile mode in
    effect (`overlaps_in_effect`: a compiled whole model overlaps no dp communication)."""
    kept = overlaps_in_effect(layout, compile)

    def said(option: str) -> str:
        if getattr(kept, option):
            return "on"
        return "off (compile=model)" if getattr(layout, option) else "off"
    return (f"overlap: tp communication {said('tp_comm_overlap')}, gradient reduce "
            f"{said('overlap_grad_reduce')}, parameter gather {said('overlap_param_gather')}")


def compile_text(req: Request, ev: Evaluation) -> str:
    """Which compile mode the prediction assumed (and why, when not the one asked)."""
    notes = []
    if ev.compile != req.compile and req.compile == "model":
        notes.append("train.compile=model refuses this layout")
    if ev.compile != "none" and not req.assumptions.compile_gain:
        notes.append("no gain assumed: these kernels are already fused; "
                     "--implementation partita models partita's eager ones, which compiling "
                     "fuses")
    kept = f"; keep_gathered: {ev.kept_units}" if ev.kept_units is not None else ""
    return f"compile: {ev.compile}" + (f" ({'; '.join(notes)})" if notes else "") + kept


def alignment_note(req: Request, layout) -> str:
    """A vocabulary whose share per tp rank is off the GEMM alignment: the output
    layer's GEMMs then run at `misaligned_gemm_fraction` of the rate (compute.gemm_time
    counts it); padding the vocabulary (model.vocab_multiple), as Megatron-LM does,
    avoids it. "" for a vocabulary that is, or is padded to, an aligned one."""
    c, align = req.model.config, req.assumptions.gemm_align
    width = vocab_rows(req.model, layout)  # rows per rank (compute.head_times)
    if not align or not misaligned(width, align):
        return ""
    multiple = aligned_vocab_multiple(layout.tp, align)
    padded = dataclasses.replace(c, vocab_multiple=multiple).padded_vocab_size
    vocab = f"{c.vocab_size:,}" + (f" (padded to {c.padded_vocab_size:,})"
                                   if c.padded_vocab_size != c.vocab_size else "")
    return (f"Note: vocabulary {vocab} over tp={layout.tp} gives output-layer GEMMs "
            f"{width:,} wide, not a multiple of {align}: they run at about "
            f"{req.assumptions.misaligned_gemm_fraction:.0%} of the GEMM rate (counted "
            f"above). Pad it to {padded:,} with --model.vocab_multiple={multiple} "
            f"(to plan it: vocab_multiple={multiple} in --model-shape or a [model] table).")


def host_note(req: Request, ev: Evaluation) -> str:
    """A microbatch paced by the host launching partita's eager operations rather than
    by the GPU (compute.host_times); "" otherwise."""
    t = ev.time
    if not t.get("host_bound"):
        return ""
    return (f"Note: host-bound: launching partita's eager operations takes "
            f"{t['host_s'] * 1e3:.1f} ms per microbatch (at "
            f"{req.assumptions.host_op_s * 1e6:.0f} us each), longer than the GPU's work; "
            "more tokens per microbatch cost the step little until the GPU catches up.")


def format_search(result: SearchResult, top: int = 10) -> str:
    req = result.request
    out = [describe_request(req), ""]
    if result.ranked:
        out.append(f"Best {min(top, len(result.ranked))} of {len(result.ranked)} layouts "
                   "that fit, fastest first:")
        out.append(format_table(result.ranked[:top]))
        if mfu_peak_note(req):
            out.append(mfu_peak_note(req))
        first = result.ranked[0]
        out.append(f"Assumed {overlap_text(first.layout, first.compile)}; "
                   f"{compile_text(req, first)}.")
        for note in (alignment_note(req, result.ranked[0].layout),
                     host_note(req, result.ranked[0])):
            if note:
                out.append(note + " (for the first layout)")
        out.append("")
        out.append("Train the first with: " + train_command(req, result.ranked[0]))
    else:
        if result.modelled:  # they fit, but use options partita train does not run yet
            out.append(f"No layout partita can train fits: {len(result.modelled)} fit in "
                       "memory but use options partita train does not run yet (below).")
        else:
            out.append("No layout fits.")
        closest = result.examples.get(MEMORY, [])
        if closest and closest[0].memory:
            e = closest[0]
            misses = "; ".join(r for k, r in e.reasons if k == MEMORY)
            out.append(f"The closest, {layout_text(e.layout)}: {misses}.")
    if result.modelled:
        out.append("")
        out.append(f"Modelled but not trainable by partita yet ({len(result.modelled)} would "
                   "fit; options marked not available yet), fastest first:")
        out.append(format_table(result.modelled[:top]))
    out.append("")
    out.append("Rejected: " + (", ".join(
        f"{n} {KIND_TITLES.get(k, k)}" for k, n in result.rejected.most_common()) or "none"))
    for kind, examples in result.examples.items():
        for e in examples:
            # The reason it is listed under (a layout that overflows may also use an
            # option not available yet).
            reason = next((r for k, r in e.reasons if k == kind), e.reasons[0][1])
            out.append(f"  {KIND_TITLES.get(kind, kind)}: {layout_text(e.layout)}: {reason}")
    out.append("")
    out.append(footer(result))
    return "\n".join(out)


def train_command(req: Request, ev: Evaluation) -> str:
    """The `partita train` settings of a ranked layout (the model and data source are
    the user's own; the sequence length is the plan's, whose batch counts sequences)."""
    args = layout_overrides(ev.layout, req.global_batch) + [f"--data.seq_len={req.seq_len}"]
    if req.precision.param == 2:  # what the plan assumed; partita train's default is fp32
        args.append("--precision.param_dtype=bfloat16")
        if req.precision.grad == 4:  # bf16-fp32-grads: gradients held and reduced in fp32
            args.append("--precision.reduce_dtype=float32")
    if ev.compile != "none":
        args.append(f"--train.compile={ev.compile}")
    if ev.kept_units is not None and ev.kept_units != 1:
        args.append(f"--parallel.keep_gathered={ev.kept_units}")
    where = ""
    if ev.layout.offload.endswith("+disk"):  # partita train refuses disk offload without it
        args.append("--parallel.offload_dir=DIR")
        where = (f" (DIR: a folder on a local disk with {ev.disk_bytes_per_node / 1e9:.0f} GB "
                 "free on each node)")
    gpus, per_node = req.cluster.num_gpus, req.cluster.gpus_per_node
    launch = f"--nproc {gpus}"
    if gpus > per_node and gpus % per_node == 0:  # the same command on every node
        launch = (f"--nnodes {gpus // per_node} --nproc {per_node} "
                  "--rdzv-endpoint HEAD:29500 --rdzv-id JOB")
        where += (f"{' and' if where else ''} on each of the {gpus // per_node} nodes "
                  "(HEAD: the first node's address, JOB: a name for the job)")
    return f"partita train {launch} " + " ".join(args) + where


def footer(result: SearchResult) -> str:
    return f"searched {result.searched} layouts in {result.seconds:.2f} s"


def format_evaluation(req: Request, ev: Evaluation) -> str:
    out = [describe_request(req), "", f"Layout: {layout_text(ev.layout)}"]
    if ev.memory:
        scale, unit = _unit(ev.memory["total"])
        out.append(f"Memory per GPU on stage {ev.peak_stage} (the peak stage), {unit}:")
        for _, key in MEMORY_COLUMNS:
            out.append(f"  {key:<18} {ev.memory[key] / scale:>9.3f}")
        out.append(f"  capacity           {ev.capacity / scale:>9.3f}")
        if ev.host_bytes_per_node:
            out.append(f"  host memory per node for offloaded states: "
                       f"{ev.host_bytes_per_node / 1e9:.1f} GB")
        if ev.disk_bytes_per_node:
            out.append(f"  disk per node for offloaded states: "
                       f"{ev.disk_bytes_per_node / 1e9:.1f} GB")
    if ev.time:
        t = ev.time
        out.append(f"Step {t['step_s']:.3f} s (compute {t['compute_s']:.3f}, bubble "
                   f"{t['bubble_s']:.3f} = {t['bubble_fraction']:.1%}, exposed communication "
                   f"{t['comm_exposed_s']:.3f}, offload {t['offload_s']:.3f}); "
                   f"{t['tokens_per_s']:.4g} tokens/s; MFU {t['mfu']:.1%}")
        out.append(f"Per GPU: {_tflops(t['model_flops_per_gpu'])} model TFLOP/s, "
                   f"{_tflops(t['hardware_flops_per_gpu'])} hardware TFLOP/s (with "
                   f"recompute; HFU {t['hfu']:.1%}); {overlap_text(ev.layout, ev.compile)}; "
                   f"{compile_text(req, ev)}")
        out += [note for note in (mfu_peak_note(req), alignment_note(req, ev.layout),
                                  host_note(req, ev)) if note]
        if t.get("stage_in_s"):
            out.append(f"Parameter shards copied from host memory for every gather "
                       f"(optimizer+params): {t['stage_in_s']:.3f} s per step, part of the "
                       "parameter gathers" + (", hidden under compute as they are"
                                              if ev.layout.overlap_param_gather else ""))
        out.append("Bytes sent per GPU per step: " + ", ".join(
            f"{k[:2]} {t[k] / 1e9:.3g} GB" for k in ("tp_bytes", "cp_bytes", "ep_bytes",
                                                     "pp_bytes", "dp_bytes") if t[k]))
    if ev.fits:
        out.append("Fits.")
    elif ev.memory and all(k == UNAVAILABLE for k, _ in ev.reasons):
        # It fits; what rejects it is an option partita train does not run yet.
        out.append(f"Fits in memory ({ev.memory['total'] / 1e9:.1f} of "
                   f"{ev.capacity / 1e9:.0f} GB), but partita train cannot run it yet, so "
                   "it is not a plan that fits:")
        out += [f"  {KIND_TITLES.get(k, k)}: {r}" for k, r in ev.reasons]
    else:
        out.append("Rejected:")
        out += [f"  {KIND_TITLES.get(k, k)}: {r}" for k, r in ev.reasons]
    return "\n".join(out)


def _unit(largest: float) -> tuple[float, str]:
    """GB for real models, MB for the tiny ones our CPU tests train."""
    return (1e9, "GB") if largest >= 1e9 else (1e6, "MB")


def to_json(req: Request, result: SearchResult | None = None, ev: Evaluation | None = None,
            top: int = 10, advice: list[str] | None = None,
            defaults: list[str] | None = None, implementation: str | None = None) -> str:
    """The plan as JSON. `implementation`: the --implementation planned for (default:
    read from the assumptions, partita's where they count its eager operations)."""
    assumptions = req.assumptions.to_dict()
    if not assumptions.get("gemm_peak_fraction"):  # 0: the GPU family's, named here
        assumptions["gemm_peak_fraction"] = family_gemm_fraction(req.cluster.gpu)
    data: dict = {
        "model": req.model.name, "parameters": req.model.total_params(),
        "model_shape": model_shape(req),
        "precision": req.precision.name,
        "precision_bytes_per_param": dataclasses.asdict(req.precision),
        "implementation": implementation or ("partita" if req.assumptions.eager_elementwise
                                             else "fused"),
        "mfu_peak_flops": mfu_peak(req),
        "gpu": req.cluster.gpu.name, "gpus": req.cluster.num_gpus,
        "gpus_per_node": req.cluster.gpus_per_node, "seq_len": req.seq_len,
        "global_batch": req.global_batch, "assumptions": assumptions,
        "compile": req.compile,
        # The count the prediction used where none was asked for (the implementation's).
        "keep_gathered": (req.assumptions.zero3_kept_units if req.keep_gathered is None
                          else req.keep_gathered),
    }
    if defaults is not None:
        data["defaults_filled_in"] = defaults
    if result is not None:
        data["fits"] = bool(result.ranked)
        data["ranked"] = [e.to_dict() for e in result.ranked[:top]]
        data["fitting"] = len(result.ranked)
        data["modelled_not_available"] = [e.to_dict() for e in result.modelled[:top]]
        data["rejected"] = dict(result.rejected)
        data["rejected_examples"] = {k: [e.to_dict() for e in v]
                                     for k, v in result.examples.items()}
        data["searched"] = result.searched
        data["search_seconds"] = result.seconds
    if ev is not None:
        data["fits"] = ev.fits
        data["evaluation"] = ev.to_dict()
    if advice is not None:
        data["advice"] = advice
    return json.dumps(data, indent=2)


def draw_memory(evals: list[Evaluation], path: str | Path) -> None:
    """Stacked bars of each layout's per-GPU memory terms, with the capacity line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PartitaError(
            "--png needs matplotlib, an optional extra: pip install 'partita[plot]'."
        ) from None
    if not evals:
        raise PartitaError("nothing to draw: no layout was evaluated.")
    names = [layout_text(e.layout) for e in evals][::-1]
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(evals) + 1.8))
    left = [0.0] * len(evals)
    for title, key in MEMORY_COLUMNS[:-1]:
        widths = [e.memory.get(key, 0.0) / 1e9 for e in evals][::-1]
        ax.barh(names, widths, left=left, label=title)
        left = [a + b for a, b in zip(left, widths)]
    ax.axvline(evals[0].capacity / 1e9, color="black", linestyle="--", label="capacity")
    ax.set_xlabel("GB per GPU (peak pipeline stage)")
    ax.legend(ncol=5, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tflops(flops_per_s: float) -> str:
    """TFLOP/s with one decimal on GPUs, three significant digits below 1 (a CPU's)."""
    tflops = flops_per_s / 1e12
    return f"{tflops:.1f}" if tflops >= 1 or tflops == 0 else f"{tflops:.3g}"
