"""The effect of `train.compile` on the planner's step time: one measured factor.

    times = step_time(model, layout, cluster, seq_len, global_batch)
    times = with_compile(times, "blocks")

Compiling the blocks fuses their memory-bound work (norms, rotary embedding, SwiGLU,
residual adds) into fewer kernels; it leaves the GEMMs, the collectives and the
optimizer step as they were. So the factor scales the compute part of a step
(`compute_s`) and nothing else; the rates that follow from the step time (tokens/s,
MFU, FLOP/s) are rescaled with it. `COMPILE_COMPUTE_FACTOR` is the steady-state step
time of compiled blocks over eager blocks measured by `partita bench compile`
(docs/benchmarks.md, 2026-12-01, CPU, fp32): the median of the three measured ratios
(tiny model 0.890 at 1 rank and 1.028 at 2; llama-20m 0.972 at 1 rank), each with a
99% interval spanning 1.0 on a loaded machine. It is a CPU figure, where the GEMMs that
compiling does not touch dominate a step; a GPU measurement should replace it.
"""

from __future__ import annotations

COMPILE_COMPUTE_FACTOR = 0.972
RATES = ("tokens_per_s", "mfu", "model_flops_per_gpu", "hardware_flops_per_gpu", "hfu")


def with_compile(times: dict[str, float], mode: str,
                 factor: float = COMPILE_COMPUTE_FACTOR) -> dict[str, float]:
    """`step_time`'s result for a run with `train.compile = mode` (none: unchanged)."""
    if mode not in ("none", "blocks", "model", "auto"):
        raise ValueError(f"compile mode {mode!r} is not one of none, blocks, model, auto")
    if mode == "none" or factor == 1.0:
        return dict(times)
    saved = (1.0 - factor) * times["compute_s"]
    out = dict(times, compute_s=times["compute_s"] - saved,
               step_s=max(times["step_s"] - saved, 1e-12))
    speedup = times["step_s"] / out["step_s"]
    for key in RATES:
        if key in out:
            out[key] = times[key] * speedup
    return out
