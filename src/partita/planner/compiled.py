"""The effect of `train.compile` on the planner's step time: one measured factor per mode.

    mode = compile_in_effect("model", layout)       # "blocks" where `model` cannot run
    times = with_compile(step_time(...), mode)

Compiling fuses the memory-bound work (norms, rotary embedding, SwiGLU, residual adds;
with `model` also the embedding, the final norm and the head's edges) into fewer
kernels and removes the per-operation overhead of eager execution; it leaves the GEMMs,
the collectives and the optimizer step as they were. So the factor scales the compute
part of a step (`compute_s`) and nothing else; the rates that follow from the step time
(tokens/s, MFU, FLOP/s) are rescaled with it.

`COMPUTE_FACTORS` are forward + backward times, compiled over eager, of partita's stage
0 in one CPU process (fp32, 4x128 tokens, one thread), measured by
`tools/compile_phases.py` on 2026-12-03 at commit b74c7b5 (docs/benchmarks.md,
"Rotary tables as graph constants"): the median of six per-round ratios, three
rounds each on the tiny model (dim 128) and `llama-20m` (dim 512), rounded. `model`
read 0.792-0.814 on the tiny model and 0.930-0.971 on `llama-20m`; `blocks` 0.811-0.846
and 0.947-0.953 (the wider the model, the larger the GEMMs' share, which compiling
leaves to the same kernels). Before the rotary tables became constants of the compiled
graphs (b74c7b5), `blocks` gained nothing this CPU could resolve. They are CPU figures;
a GPU, where eager launch overhead and memory-bound kernels weigh differently, needs its
own measurement.
"""

from __future__ import annotations

from partita.compile_rules import MODES, model_refusal
from partita.layout import Layout

COMPUTE_FACTORS = {"blocks": 0.90, "model": 0.87}
RATES = ("tokens_per_s", "mfu", "model_flops_per_gpu", "hardware_flops_per_gpu", "hfu")


def compile_in_effect(mode: str, layout: Layout) -> str:
    """The mode a run of `layout` compiles with when asked for `mode`: `auto` compiles
    blocks (as the trainer resolves it where the toolchain works), and `model` falls back
    to blocks on a layout that cannot be compiled in one piece (`model_refusal`: the
    trainer refuses those, the planner shows what blocks would give)."""
    if mode not in MODES:
        raise ValueError(f"compile mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "auto" or (mode == "model" and model_refusal(layout)):
        return "blocks"
    return mode


def with_compile(times: dict[str, float], mode: str,
                 factor: float | None = None) -> dict[str, float]:
    """`step_time`'s result for a run compiled with `mode` (a mode in effect: none,
    blocks or model); `factor` overrides the mode's measured one."""
    if mode not in MODES or mode == "auto":
        raise ValueError(f"compile mode {mode!r} is not one of none, blocks, model")
    if mode == "none":
        return dict(times)
    factor = COMPUTE_FACTORS[mode] if factor is None else factor
    saved = (1.0 - factor) * times["compute_s"]
    out = dict(times, compute_s=times["compute_s"] - saved,
               step_s=max(times["step_s"] - saved, 1e-12))
    speedup = times["step_s"] / out["step_s"]
    for key in RATES:
        if key in out:
            out[key] = times[key] * speedup
    return out
