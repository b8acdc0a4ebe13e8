"""Which attention kernel a call runs: torch's scaled-dot-product attention or explicit scores.

`model.attention` chooses:

* "sdpa": `torch.nn.functional.scaled_dot_product_attention`, a flash-style kernel
  that keeps no seq x seq scores (on CPU torch's own flash kernel).
* "explicit": two batched GEMMs around a softmax (`transformer.explicit_attention`),
  which keeps the softmax output (2 bytes per score in bf16) for backward.
* "auto" (default): explicit for bf16 on a CPU while one call's scores (batch x heads
  x queries x keys) stay within `EXPLICIT_SCORES_LIMIT`, sdpa otherwise.

Why "auto" does that: on CPU torch's flash kernel is slow in bf16 at short sequences,
where bf16 GEMMs (twice the fp32 rate on CPUs with AVX-512 BF16 or AMX) and a softmax
on scores that fit in cache are faster. Measured forward + backward, one thread, AMD
EPYC Zen 4 (2026-12-05, `docs/performance.md`): at (batch, heads, seq, head_dim)
(4, 4, 128, 32) flash 5.4 ms, explicit 1.9; (1, 8, 256, 64) 7.3 and 4.1; (1, 8, 512,
64) 24.5 and 23.4; past about 2M scores explicit falls behind ((2, 8, 512, 64) 48 and
50; (1, 8, 768, 64) 37 and 49). In fp32 flash is the faster at every shape measured,
and on GPUs the flash kernels are. Torch-free, so the planner applies the same rule.
"""

from __future__ import annotations

KERNELS = ("auto", "sdpa", "explicit")

# Scores per call (batch x heads x queries x keys) up to which "auto" computes bf16
# attention on a CPU explicitly: about where the two kernels' times cross on the CPU
# above (4 MB of bf16 scores).
EXPLICIT_SCORES_LIMIT = 2 ** 21


def uses_explicit_scores(kernel: str, device_type: str, dtype_name: str, scores: float) -> bool:
    """Whether an attention call under `model.attention = kernel` computes explicit
    scores, on a `device_type` ("cpu", "cuda") device in `dtype_name` ("bfloat16", ...)
    with `scores` = batch x heads x queries x keys."""
    if kernel != "auto":
        return kernel == "explicit"
    return device_type == "cpu" and dtype_name == "bfloat16" and scores <= EXPLICIT_SCORES_LIMIT
