"""The valid range of every run setting, checked before any process starts.

`config.py` gives each setting a type; this table gives the values that make sense,
so a zero step count, a negative learning rate or `beta1 = 1.5` is refused with one
message instead of "succeeding" with nonsense or failing inside every worker. The
parallel degrees and policies have their own ranges here (a degree is a positive
integer, a recompute policy one of three); how they combine with each other, the model
and the world is the layout's, checked by its own validation with those in view. The
pipeline schedule's names (and old spellings) are the layout's too.

`check_ranges(cfg)` raises one PartitaError listing every setting out of range. A test
checks that every numeric setting of `Config` has an entry, so a new one cannot be
added without saying what is valid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from partita.errors import PartitaError
from partita.layout import OFFLOAD, RECOMPUTE

# Every dtype name a setting takes, each to its full name (the short ones are aliases).
CANONICAL_DTYPE = {"float32": "float32", "float64": "float64", "bfloat16": "bfloat16",
                   "float16": "float16", "fp32": "float32", "fp64": "float64",
                   "bf16": "bfloat16", "fp16": "float16"}
DTYPE_NAMES = tuple(CANONICAL_DTYPE)


@dataclass(frozen=True)
class Rule:
    """`ok(value)` says whether a value is valid; `text` says what is, for the message;
    `outside` lists values just outside the range (used by the tests)."""

    ok: Callable[[object], bool]
    text: str
    outside: tuple = ()


def number_range(lo: float | None = None, hi: float | None = None, lo_open: bool = False,
         hi_open: bool = False) -> Rule:
    def ok(v: object) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            return False
        if lo is not None and (v <= lo if lo_open else v < lo):
            return False
        return not (hi is not None and (v >= hi if hi_open else v > hi))

    left = "" if lo is None else (f"> {_number(lo)}" if lo_open else f">= {_number(lo)}")
    right = "" if hi is None else (f"< {_number(hi)}" if hi_open else f"<= {_number(hi)}")
    text = " and ".join(p for p in (left, right) if p)
    outside = tuple(x for x in ((lo - 1 if not lo_open else lo) if lo is not None else None,
                                (hi + 1 if not hi_open else hi) if hi is not None else None)
                    if x is not None)
    return Rule(ok, text, outside)


def _number(x: float) -> str:
    """A bound as written in messages: integers in full (a seed's 4294967295, not
    4.29497e+09), other numbers short."""
    return f"{int(x)}" if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def _choice(*options: str) -> Rule:
    return Rule(lambda v: v in options, "one of " + ", ".join(options), ("nonsense",))


def _device() -> Rule:
    def ok(v: object) -> bool:
        if v in ("auto", "cpu", "cuda"):
            return True
        head, _, index = str(v).partition(":")
        return head == "cuda" and index.isdigit()
    return Rule(ok, "auto, cpu, cuda or cuda:N", ("gpu", "cuda:x"))


def _dtype(optional: bool) -> Rule:
    names = DTYPE_NAMES + (("",) if optional else ())
    text = ", ".join(DTYPE_NAMES[:4]) + (" (or empty: inherit)" if optional else "")
    return Rule(lambda v: v in names, text, ("float8", "int32"))


def _degree(zero_means: str = "") -> Rule:
    """A parallel degree: a positive integer (1 turns the dimension off), or for dp also
    0, which `Config.layout` resolves from the world size."""
    low = 0 if zero_means else 1
    text = "a positive integer (1 turns that dimension off)" + (
        f", or 0: {zero_means}" if zero_means else "")
    return Rule(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low, text,
                (low - 1,))


AT_LEAST_1 = number_range(1)
AT_LEAST_0 = number_range(0)
POSITIVE = number_range(0, lo_open=True)
FRACTION = number_range(0, 1, hi_open=True)  # [0, 1)
# Seeds feed torch.manual_seed (64 bits) after adding a rank or an index, and numpy's
# SeedSequence; 32 bits leave room for any such offset.
SEED = number_range(0, 2**32 - 1)
# gloo and NCCL take timeouts as C++ durations, which overflow somewhere past 1e11 s; a
# week is longer than any collective should wait and far inside that.
TIMEOUT = number_range(0, 7 * 24 * 3600, lo_open=True)

RANGES: dict[str, Rule] = {
    # [model]: only the keys set override the catalog entry (None means "keep").
    "model.vocab_size": AT_LEAST_1,
    # Padding is for GEMM alignment: lcm(64, 8 * tp) stays within 4096 up to tp = 512; a
    # larger multiple only adds rows that are never used (1,000,000 made a 256-token
    # model 257M parameters).
    "model.vocab_multiple": number_range(1, 4096),
    "model.dim": AT_LEAST_1,
    "model.n_layers": AT_LEAST_1,
    "model.n_heads": AT_LEAST_1,
    "model.n_kv_heads": AT_LEAST_1,
    "model.ffn_dim": AT_LEAST_1,
    "model.max_seq_len": AT_LEAST_1,
    "model.attention_window": AT_LEAST_1,
    "model.flavour": _choice("llama", "gpt2"),
    "model.dropout": FRACTION,
    "model.seed": SEED,
    "model.rope_theta": POSITIVE,
    "model.norm_eps": POSITIVE,
    "model.rope_scaling": _choice("", "llama3"),
    "model.attention": _choice("auto", "sdpa", "explicit"),
    "model.rope_factor": POSITIVE,
    "model.rope_low_freq_factor": POSITIVE,
    "model.rope_high_freq_factor": POSITIVE,
    "model.rope_original_max_len": AT_LEAST_1,
    "model.n_experts": AT_LEAST_0,
    "model.top_k": AT_LEAST_1,
    "model.moe_every": AT_LEAST_1,
    "model.expert_ffn_dim": AT_LEAST_1,
    "model.capacity_factor": POSITIVE,
    "model.router_gating": _choice("softmax", "sigmoid"),
    "model.shared_experts": AT_LEAST_0,
    "model.aux_loss_weight": AT_LEAST_0,
    "model.z_loss_weight": AT_LEAST_0,
    # [data]
    "data.seq_len": number_range(2),  # a window needs an input and a next token
    "data.val_fraction": FRACTION,
    "data.max_bytes": AT_LEAST_1,
    "data.seed": SEED,
    "data.bad_lines": _choice("error", "skip"),
    "data.workers": AT_LEAST_0,
    # [train]
    "train.steps": AT_LEAST_1,
    "train.global_batch": AT_LEAST_1,
    "train.microbatches": AT_LEAST_1,
    "train.lr": AT_LEAST_0,
    "train.min_lr": AT_LEAST_0,
    "train.warmup_steps": AT_LEAST_0,
    "train.weight_decay": AT_LEAST_0,
    "train.beta1": FRACTION,
    "train.beta2": FRACTION,
    "train.eps": POSITIVE,
    "train.grad_clip": AT_LEAST_0,
    "train.eval_every": AT_LEAST_1,
    "train.eval_batches": AT_LEAST_0,
    "train.log_every": AT_LEAST_1,
    "train.dtype": _dtype(optional=False),
    "train.device": _device(),
    "train.max_bad_steps": AT_LEAST_0,
    "train.threads": AT_LEAST_0,
    "train.collective_timeout_s": TIMEOUT,
    "train.stall_warning_factor": AT_LEAST_0,
    "train.checkpoint_every": AT_LEAST_0,
    "train.keep_last": AT_LEAST_0,
    "train.stop_after": AT_LEAST_0,
    "train.checkpoint_failure": _choice("stop", "continue"),
    "train.export": _choice("", "hf"),
    "train.compile": _choice("none", "blocks", "model", "auto"),
    # [parallel]: each value alone (how they combine, and schedules: see the layout).
    "parallel.dp": _degree("what the world size leaves after tp*pp*cp"),
    "parallel.tp": _degree(),
    "parallel.pp": _degree(),
    "parallel.cp": _degree(),
    "parallel.ep": _degree(),
    "parallel.zero_stage": Rule(lambda v: v in (0, 1, 2, 3) and not isinstance(v, bool),
                                "0 (plain data parallel), 1 (shard optimizer state), 2 "
                                "(+ gradients) or 3 (+ parameters)", (-1, 4)),
    "parallel.virtual_stages": AT_LEAST_0,
    "parallel.recompute": _choice(*RECOMPUTE),
    "parallel.recompute_layers": AT_LEAST_0,
    "parallel.offload": _choice(*OFFLOAD),
    "parallel.bucket_mb": POSITIVE,
    "parallel.prefetch": AT_LEAST_0,
    "parallel.keep_gathered": AT_LEAST_0,
    "parallel.accumulation": _choice("reduce", "buffer"),
    "parallel.pp_balance": _choice("even", "params", "flops"),
    "parallel.pp_timeout_s": TIMEOUT,
    "parallel.host_memory_budget_gb": POSITIVE,
    "parallel.cp_kind": _choice("ring", "allgather"),
    "parallel.moe_tp": _choice("replicate", "experts", "hidden"),
    # [precision]
    "precision.param_dtype": _dtype(optional=True),
    "precision.reduce_dtype": _dtype(optional=True),
    # [metrics]
    "metrics.peak_tflops": AT_LEAST_0,
}


def out_of_range(cfg, section_only: str = "") -> list[str]:
    """One line per setting of `cfg` outside its range (empty when all are valid); with
    `section_only`, only that section's own ranges."""
    problems = []
    for dotted, rule in RANGES.items():
        section, key = dotted.split(".")
        if section_only and section != section_only:
            continue
        value = getattr(getattr(cfg, section), key)
        if value is None and section == "model":
            continue  # not set: the catalog's value, which is valid
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{dotted}={value!r} is not a finite number: use {rule.text}")
        elif not rule.ok(value):
            problems.append(f"{dotted}={value!r} is out of range: use {rule.text}")
    if section_only:
        return problems
    if cfg.train.min_lr > cfg.train.lr >= 0:
        problems.append(f"train.min_lr={cfg.train.min_lr:g} exceeds train.lr="
                        f"{cfg.train.lr:g}: the schedule decays from lr down to min_lr")
    if cfg.param_dtype_name == "float16" and not cfg.precision.master_weights:
        # Most of Adam's updates are below float16's resolution near the weights' values,
        # and the run diverges (loss 5.5 -> 13, infinite norms on most steps) with exit 0.
        given = ("precision.param_dtype" if cfg.precision.param_dtype else "train.dtype")
        written = cfg.precision.param_dtype or cfg.train.dtype
        problems.append(f"precision.master_weights=false with {given}={written}: "
                        "float16 parameters updated in float16 lose most of each update "
                        "to rounding and the run diverges; keep precision.master_weights="
                        "true (an fp32 master copy), or train in bfloat16 "
                        "(precision.param_dtype=bfloat16), which may go without one")
    max_len = cfg.model.max_seq_len
    if (max_len is not None and RANGES["model.max_seq_len"].ok(max_len)
            and RANGES["data.seq_len"].ok(cfg.data.seq_len) and cfg.data.seq_len > max_len):
        problems.append(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len="
                        f"{max_len}: the model would be built with {cfg.data.seq_len} "
                        f"positions instead; raise model.max_seq_len to at least "
                        f"{cfg.data.seq_len}, leave it unset, or shorten data.seq_len")
    return problems


def check_ranges(cfg, section_only: str = "") -> None:
    """Raise PartitaError naming every setting of `cfg` that is out of range (with
    `section_only`, of that section)."""
    problems = out_of_range(cfg, section_only)
    if problems:
        raise PartitaError("invalid settings: " + "; ".join(problems) + ".")
