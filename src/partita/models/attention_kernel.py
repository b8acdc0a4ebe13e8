"""Which attention kernel a call runs: torch's scaled-dot-product attention or explicit scores.

`model.attention` chooses:

* "sdpa": `torch.nn.functional.scaled_dot_product_attention`, a flash-style kernel
  that keeps no seq x seq scores (on CPU torch's own flash kernel).
* "explicit": two batched GEMMs around a softmax (`transformer.explicit_attention`),
  which keeps the softmax output (2 bytes per score in bf16) for backward.
* "auto" (default): explicit for bf16 on a CPU with bf16 units (AVX-512 BF16 or AMX)
  while one call's scores (batch x heads x queries x keys) stay within the limit of
  that kind of unit (`explicit_scores_limit`), sdpa otherwise.

Why "auto" does that: on CPU torch's flash kernel is slow in bf16, where bf16 GEMMs
(twice the fp32 rate or more on CPUs with AVX-512 BF16 or AMX) and a softmax are faster
while the scores stay small. Measured forward + backward, one thread
(`tools/attention_kernels.py`, docs/performance.md), at (batch, heads, seq, head_dim):

* AMD EPYC Zen 4, AVX-512 BF16 (2026-12-05): (4, 4, 128, 32) flash 5.3 ms, explicit
  2.5; (1, 8, 512, 64) 24.1 and 11.9; (2, 8, 512, 64) 48.0 and 24.3; (1, 8, 1024, 64),
  8M scores, 58.7 and 47.6 in one run and 63.5 and 68.0 in another; past that flash is
  the faster ((4, 8, 1024, 64) 245 and 352).
* An Intel Xeon with AMX (2026-12-05, three runs), whose flash kernel runs its bf16
  products on AMX tiles: (4, 4, 128, 32) 4.9-5.2 and 1.3-2.2; (1, 8, 512, 64), 2M
  scores, 10.7-12.1 and 7.0-11.5; from 3M either leads by run ((2, 8, 512, 64) 22.3-25.6
  and 26.7-27.4), and at 8M flash mostly ((1, 8, 1024, 64) 27.7-28.9 and 30.8-60.5).

In fp32 flash is as fast or faster at every shape measured, and on GPUs the flash
kernels are. Torch-free, so the planner applies the same rule.
"""

from __future__ import annotations

KERNELS = ("auto", "sdpa", "explicit")

# What bf16 instructions a CPU has: none, AVX-512 BF16 (dot products in vector
# registers), or AMX (tile matrix units, which speed up torch's flash kernel as well).
BF16_UNITS = ("none", "avx512", "amx")

# Scores per call (batch x heads x queries x keys) up to which "auto" computes bf16
# attention on a CPU explicitly, by the CPU's bf16 units: on the AVX-512 CPU above half
# of where the two kernels' times cross, where explicit scores still took half to three
# quarters of flash's time (and keep 8 MB of bf16 softmax output per call for
# backward); with AMX the largest size where explicit scores never lost.
EXPLICIT_SCORES_LIMITS = {"avx512": 2 ** 22, "amx": 2 ** 21}


def explicit_scores_limit(bf16_units: str) -> int:
    """The most scores per call "auto" computes explicitly on a CPU with `bf16_units`
    (one of `BF16_UNITS`; 0: none)."""
    return EXPLICIT_SCORES_LIMITS.get(bf16_units, 0)


def uses_explicit_scores(kernel: str, device_type: str, dtype_name: str, scores: float,
                         bf16_units: str = "avx512") -> bool:
    """Whether an attention call under `model.attention = kernel` computes explicit
    scores, on a `device_type` ("cpu", "cuda") device in `dtype_name` ("bfloat16", ...)
    with `scores` = batch x heads x queries x keys; `bf16_units`: that CPU's bf16
    instructions (`BF16_UNITS`; without them its bf16 GEMMs run far below fp32's rate
    and the explicit path's speed was never measured there, so "auto" keeps torch's
    kernel)."""
    if kernel != "auto":
        return kernel == "explicit"
    return (device_type == "cpu" and dtype_name == "bfloat16"
            and scores <= explicit_scores_limit(bf16_units))


def bf16_units_from_flags(flags: set[str]) -> str:
    """A CPU's bf16 units from its feature flags as Linux lists them in /proc/cpuinfo
    (`amx_bf16`, `avx512_bf16`)."""
    if "amx_bf16" in flags:
        return "amx"
    return "avx512" if "avx512_bf16" in flags else "none"
