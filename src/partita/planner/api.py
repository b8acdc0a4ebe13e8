"""The planner as a Python API: describe a request, search it or judge one layout.

    from partita.planner import plan, evaluate_layout
    result = plan("llama3-70b", gpus=512, gpu_type="H100", seq_len=8192)
    print(result.best.layout.describe(), result.best.memory["total"] / 1e9)
"""

from __future__ import annotations

import dataclasses

from partita.compile_rules import MODES
from partita.errors import PartitaError
from partita.layout import Layout, parse_layout
from partita.planner.assumptions import Assumptions
from partita.planner.evaluate import Evaluation, Request, evaluate
from partita.planner.hardware import Cluster, GPUSpec, get_gpu, load_gpu_profiles
from partita.planner.model_shape import PlanModel, resolve_model
from partita.planner.precision import Precision
from partita.planner.search import DEFAULT_SPACE, SearchResult, SearchSpace, search

# Default global batch: about 4M tokens per step, the order of GPT-3's 3.2M and the
# 4M Llama 3 started from, expressed in sequences of the requested length.
DEFAULT_BATCH_TOKENS = 2**22


def make_request(model: str | PlanModel, gpus: int, gpu_type: str | GPUSpec = "H100",
                 gpus_per_node: int | None = None, seq_len: int | None = None,
                 global_batch: int | None = None, precision: str | Precision = "bf16",
                 assumptions: Assumptions | None = None,
                 hardware_file: str | None = None, compile: str = "none",
                 keep_gathered: int | str | None = None) -> Request:
    """A `Request` from names: model catalog name or TOML path, GPU type or profile;
    `compile` is train.compile (none, blocks, model, auto); `keep_gathered` is ZeRO-3's
    parallel.keep_gathered (a count, "auto": the most that fit, or None: the
    assumptions' `zero3_kept_units`)."""
    plan_model = resolve_model(model) if isinstance(model, str) else model
    extra = load_gpu_profiles(hardware_file) if hardware_file else None
    gpu = get_gpu(gpu_type, extra) if isinstance(gpu_type, str) else gpu_type
    # A model with a sliding window trains at sequences up to it (Config.model_config).
    window = plan_model.config.attention_window
    seq = seq_len or plan_model.config.longest_sequence
    if seq < 1 or gpus < 1:
        raise PartitaError("--seq-len and --gpus must be positive.")
    if window is not None and seq > window:
        raise PartitaError(f"--seq-len {seq} exceeds the model's attention window of {window} "
                           "positions, which partita trains at sequences up to; give "
                           f"--seq-len {window} or less.")
    if seq > plan_model.config.max_seq_len:  # as partita train does (Config.model_config):
        # the model is built for the sequence, GPT-2's learned positions grown to it
        plan_model = dataclasses.replace(
            plan_model, config=dataclasses.replace(plan_model.config, max_seq_len=seq))
    batch = global_batch or default_global_batch(seq)
    prec = Precision.named(precision) if isinstance(precision, str) else precision
    cluster = Cluster(gpu, gpus, gpus_per_node or gpu.gpus_per_node)
    if compile not in MODES:
        raise PartitaError(f"--compile {compile}: choose one of {', '.join(MODES)}.")
    if keep_gathered is not None and keep_gathered != "auto" and (
            not isinstance(keep_gathered, int) or keep_gathered < 0):
        raise PartitaError(f"--keep-gathered {keep_gathered}: give a number of gather "
                           "units >= 0 or auto (the most that fit).")
    return Request(plan_model, cluster, seq, batch, prec,
                   assumptions or Assumptions.for_device(gpu.name), compile, keep_gathered)


def default_global_batch(seq_len: int) -> int:
    """About DEFAULT_BATCH_TOKENS in sequences of `seq_len`, rounded down to a power of
    two so that it divides over power-of-two data-parallel degrees and microbatches
    (4,194,304 // 8,196 is 511, which no dp > 1 divides: every dp layout was excluded)."""
    sequences = max(1, DEFAULT_BATCH_TOKENS // seq_len)
    return 1 << (sequences.bit_length() - 1)


def plan(model: str | PlanModel, gpus: int, space: SearchSpace = DEFAULT_SPACE,
         **request_options) -> SearchResult:
    """Every layout for `model` on `gpus` GPUs, the fitting ones ranked fastest first."""
    return search(make_request(model, gpus, **request_options), space)


def evaluate_layout(model: str | PlanModel, gpus: int, layout: str | Layout,
                    **request_options) -> Evaluation:
    """Memory, time and rejection reasons of one layout (`"dp=8 tp=2 pp=2 zero_stage=1"`)."""
    req = make_request(model, gpus, **request_options)
    lay = parse_layout(layout, gpus) if isinstance(layout, str) else layout
    return evaluate(req, lay)
