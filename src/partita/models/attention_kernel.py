"""Which attention kernel a call runs: torch's scaled-dot-product attention or explicit scores.

`model.attention` chooses:

* "sdpa": `torch.nn.functional.scaled_dot_product_attention`, a flash-style kernel
  that keeps no seq x seq scores (on CPU torch's own flash kernel).
* "explicit": two batched GEMMs around a softmax (`transformer.explicit_attention`),
  which keeps the softmax output (2 bytes per score in bf16) for backward.
* "auto" (default): explicit for bf16 on a CPU with bf16 units (AVX-512 BF16 or AMX)
  while one call's scores (batch x heads x queries x keys) stay within
  `EXPLICIT_SCORES_LIMIT`, sdpa otherwise.

Why "auto" does that: on CPU torch's flash kernel is slow in bf16, where bf16 GEMMs
(twice the fp32 rate on CPUs with AVX-512 BF16 or AMX) and a softmax are faster while
the scores stay small. Measured forward + backward, one thread, AMD EPYC Zen 4
(2026-12-05, `tools/attention_kernels.py`, docs/performance.md): at (batch, heads, seq,
head_dim) (4, 4, 128, 32) flash 5.3 ms, explicit 2.5; (1, 8, 512, 64) 24.1 and 11.9;
(2, 8, 512, 64) 48.0 and 24.3; (1, 8, 1024, 64), 8M scores, 58.7 and 47.6 in one run and
63.5 and 68.0 in another; past that flash is the faster ((4, 8, 1024, 64) 245 and 352).
In fp32 flash is as fast or faster at every shape measured, and on GPUs the flash
kernels are. Torch-free, so the planner applies the same rule.
"""

from __future__ import annotations

KERNELS = ("auto", "sdpa", "explicit")

# Scores per call (batch x heads x queries x keys) up to which "auto" computes bf16
# attention on a CPU explicitly: half of where the two kernels' times cross on the CPU
# above, where explicit scores still took half to three quarters of flash's time (and
# keep 8 MB of bf16 softmax output per call for backward).
EXPLICIT_SCORES_LIMIT = 2 ** 22


def uses_explicit_scores(kernel: str, device_type: str, dtype_name: str, scores: float,
                         bf16_units: bool = True) -> bool:
    """Whether an attention call under `model.attention = kernel` computes explicit
    scores, on a `device_type` ("cpu", "cuda") device in `dtype_name` ("bfloat16", ...)
    with `scores` = batch x heads x queries x keys; `bf16_units`: whether that CPU has
    bf16 instructions (without them its bf16 GEMMs run far below fp32's rate, and the
    explicit path's speed was never measured there, so "auto" keeps torch's kernel)."""
    if kernel != "auto":
        return kernel == "explicit"
    return (device_type == "cpu" and dtype_name == "bfloat16" and bf16_units
            and scores <= EXPLICIT_SCORES_LIMIT)
