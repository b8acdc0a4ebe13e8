"""Named model shapes: tiny presets that train on CPU, and real published shapes.

The real shapes are for counting and planning (build them on the meta device); their
figures come from the papers and released configs of each model family.
"""

from __future__ import annotations

from partita.errors import PartitaError, did_you_mean
from partita.models.model_config import ModelConfig

MODELS: dict[str, ModelConfig] = {
    # CPU presets. `tiny` is the default of `partita train`.
    "tiny": ModelConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                        max_seq_len=128),
    # `tiny` with every second block a mixture of 8 experts, top-2 (expert parallelism).
    "tiny-moe": ModelConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                            max_seq_len=128, n_experts=8, top_k=2, moe_every=2),
    "tiny-gpt2": ModelConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, max_seq_len=128,
                             flavour="gpt2", tie_embeddings=True),
    "small": ModelConfig(vocab_size=256, dim=256, n_layers=8, n_heads=8, n_kv_heads=4,
                         max_seq_len=256),
    # Benchmark sizes: a step-time ratio read on `tiny` (39 small tensors) need not hold
    # where tensors are many and large. 21.2M and 97.6M parameters.
    "llama-20m": ModelConfig(vocab_size=8192, dim=512, n_layers=4, n_heads=8,
                             max_seq_len=2048),
    "llama-100m": ModelConfig(vocab_size=8192, dim=768, n_layers=12, n_heads=12,
                              max_seq_len=2048),
    # Published shapes. GPT-2's vocabulary of 50,257 is stored padded to 50,304 rows
    # (vocab_multiple, as nanoGPT does; Megatron-LM pads it too), so the output head's
    # GEMM stays aligned on GPUs: 124.48M and 174.60B parameters, the padding counted.
    "gpt2-124m": ModelConfig(vocab_size=50257, vocab_multiple=64, dim=768, n_layers=12,
                             n_heads=12, max_seq_len=1024, flavour="gpt2",
                             tie_embeddings=True),
    "gpt3-175b": ModelConfig(vocab_size=50257, vocab_multiple=64, dim=12288, n_layers=96,
                             n_heads=96, max_seq_len=2048, flavour="gpt2",
                             tie_embeddings=True),
    "llama3-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                             n_kv_heads=8, ffn_dim=14336, max_seq_len=8192,
                             rope_theta=500000.0),
    "llama3-70b": ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64,
                              n_kv_heads=8, ffn_dim=28672, max_seq_len=8192,
                              rope_theta=500000.0),
    "llama3-405b": ModelConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128,
                               n_kv_heads=8, ffn_dim=53248, max_seq_len=8192,
                               rope_theta=500000.0),
    # Llama 3.2 1B's shape (tied embeddings, Llama 3 RoPE scaling as in its config.json).
    # One GPU trains it with room to spare: `partita bench gpu` uses it.
    "llama3.2-1b": ModelConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32,
                               n_kv_heads=8, ffn_dim=8192, max_seq_len=131072,
                               rope_theta=500000.0, tie_embeddings=True,
                               rope_scaling="llama3", rope_factor=32.0,
                               rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                               rope_original_max_len=8192),
    # Mixtral 8x7B (its config.json): every block 8 experts, top-2, 46.7B parameters.
    "mixtral-8x7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32,
                                n_kv_heads=8, ffn_dim=14336, max_seq_len=32768,
                                rope_theta=1e6, n_experts=8, top_k=2),
    # DeepSeek-V3's widths and routing (256 routed experts of 2048, top-8, one shared,
    # sigmoid gating) on partita's block: grouped-query attention stands in for MLA and
    # every block is MoE (V3 keeps its first three dense). For planning only.
    "deepseek-v3-like": ModelConfig(vocab_size=129280, dim=7168, n_layers=61, n_heads=128,
                                    ffn_dim=18432, max_seq_len=4096, n_experts=256,
                                    top_k=8, expert_ffn_dim=2048, shared_experts=1,
                                    router_gating="sigmoid"),
    "llama2-7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32,
                             ffn_dim=11008, max_seq_len=4096),
    # Mistral 7B v0.3 (no sliding window) and Qwen2.5 7B (Llama with q/k/v biases), from
    # their config.json: 7.25B and 7.62B parameters.
    "mistral-7b": ModelConfig(vocab_size=32768, dim=4096, n_layers=32, n_heads=32,
                              n_kv_heads=8, ffn_dim=14336, max_seq_len=32768,
                              rope_theta=1e6),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, dim=3584, n_layers=28, n_heads=28,
                              n_kv_heads=4, ffn_dim=18944, max_seq_len=131072,
                              rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
}


def get_model_config(name: str) -> ModelConfig:
    """The catalog entry called `name`; the error lists the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise PartitaError(
            f"unknown model '{name}'.{did_you_mean(name, MODELS)} "
            f"Known models: {', '.join(MODELS)}; or give model settings in a config file."
        ) from None
