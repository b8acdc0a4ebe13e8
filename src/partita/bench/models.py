"""The models the step-time benchmarks run: partita's catalog and a `transformers` Llama.

    model, vocab = bench_model("hf-llama-20m", device)

A name from partita's catalog (`partita.models.catalog`: the default `tiny`, the CPU
presets `llama-20m` and `llama-100m`, `tiny-moe` (tiny with a mixture of 8 experts,
top-2, in every second block, all on each rank), or any other) builds partita's own
Transformer; a
name from `HF_MODELS` builds a `transformers` LlamaForCausalLM through partita's adapter
(`partita.models.hf_llama`). The tiny model has 39 parameter tensors of 0.8M elements in
all; a speed that holds there need not hold where there are many larger tensors, so the
step-time ratios are worth reading on the larger ones too.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

# transformers Llamas: (hidden, layers, heads, ffn, vocab). 21.2M parameters, the shape
# of partita's `llama-20m`, which makes the two directly comparable.
HF_MODELS: dict[str, tuple[int, int, int, int, int]] = {
    "hf-llama-20m": (512, 4, 8, 1408, 8192),
}

# The names `--model` suggests (any catalog name is accepted too).
CHOICES = ("tiny", "llama-20m", "llama-100m", "tiny-moe", *HF_MODELS)


def model_name(text: str) -> str:
    """The argparse type of `--model`: a name `bench_model` can build, checked while the
    arguments are parsed (an unknown one would otherwise fail in every spawned rank)."""
    from partita.errors import did_you_mean
    from partita.models.catalog import MODELS

    known = [*MODELS, *HF_MODELS]
    if text not in known:
        raise argparse.ArgumentTypeError(
            f"unknown model '{text}'.{did_you_mean(text, known)} The benchmarks build "
            f"partita's catalog models and transformers Llamas: {', '.join(known)}.")
    return text


def bench_model(name: str, device: torch.device | str = "cpu") -> tuple[nn.Module, int]:
    """(an initialised float32 model, its vocabulary size)."""
    if name in HF_MODELS:
        from transformers import LlamaConfig

        from partita.models.hf_llama import llama_model

        hidden, layers, heads, ffn, vocab = HF_MODELS[name]
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=heads,
                             intermediate_size=ffn, max_position_embeddings=2048,
                             tie_word_embeddings=False, pad_token_id=None,
                             attn_implementation="sdpa")
        return llama_model(config, device=device)[0], vocab
    from partita.models.catalog import get_model_config
    from partita.models.transformer import build_model

    cfg = get_model_config(name)
    return build_model(cfg, device=device), cfg.vocab_size


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (what FSDP2 and ZeRO-3 gather one at a time)."""
    holder = model.blocks if hasattr(model, "blocks") else model.layers
    return list(holder.values())


def block_names(model: nn.Module) -> list[str]:
    """The blocks' module names, for partita's `DataParallel(blocks=...)`."""
    attr = "blocks" if hasattr(model, "blocks") else "layers"
    return [f"{attr}.{key}" for key in getattr(model, attr)]


def pipeline_config(stages: int, schedule: str, virtual_stages: int, layers: int,
                    args: argparse.Namespace, vocab: int):
    """The run configuration of the pipeline benchmarks (`bench pp`, `pp-bubble`): a
    model `args.dim` wide, one head per 64 of it, kv heads in pairs where the heads
    allow (so any --dim gives a valid model), `args.microbatches` microbatches of
    `args.microbatch_size` sequences of `args.seq` tokens."""
    import math

    from partita.config import Config

    cfg = Config()
    heads = max(1, args.dim // 64)
    cfg.model.vocab_size, cfg.model.dim, cfg.model.n_layers = vocab, args.dim, layers
    cfg.model.n_heads, cfg.model.n_kv_heads = heads, math.gcd(heads, 2)
    cfg.data.seq_len = args.seq
    cfg.train.microbatches = args.microbatches
    cfg.train.global_batch = args.microbatches * args.microbatch_size
    cfg.parallel.pp, cfg.parallel.schedule = stages, schedule
    cfg.parallel.virtual_stages = virtual_stages
    cfg.model_config()  # a shape the model cannot take is said here, not by a worker
    return cfg

