"""Small random Hugging Face Llama folders for the import/export tests, and transformers
patched to compute in float64 throughout.

transformers computes its RMSNorm, rotary angles (from float32 inverse frequencies) and
eager softmax in float32 even in a float64 model, which puts a floor of ~1e-7 under any
comparison with it. `transformers_in_float64` replaces the norm's and the rotary
embedding's forward with the same formulas in the input's dtype (the tests use the sdpa
attention, which has no float32 step), so float64 logits can be compared at 1e-10. The
formulas are transformers' own, rewritten without the casts; the rotary table uses the
default (unscaled) frequencies, 1 / theta^(2i/d), so parity tests use unscaled RoPE and
the Llama 3 scaling is checked against transformers' float32 frequencies separately.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

transformers = __import__("pytest").importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402

# The families partita imports: (config class, model class), and the modules whose norm
# and rotary embedding `transformers_in_float64` patches.
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
}
_FLOAT32_STEPS = [(modeling_llama.LlamaRMSNorm, modeling_llama.LlamaRotaryEmbedding),
                  (modeling_mistral.MistralRMSNorm, modeling_mistral.MistralRotaryEmbedding),
                  (modeling_qwen2.Qwen2RMSNorm, modeling_qwen2.Qwen2RotaryEmbedding),
                  (modeling_mixtral.MixtralRMSNorm, modeling_mixtral.MixtralRotaryEmbedding)]

# Llama 3's RoPE scaling at a length the small test models reach.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def edit_config(folder: Path, **changes) -> Path:
    """Change keys of the folder's config.json (None removes a key)."""
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def llama_config(vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 4,
                 kv_heads: int = 2, ffn: int = 64, tied: bool = False, family: str = "llama",
                 **extra):
    # Copies: transformers writes into a rope dict it is given (its rope_theta).
    extra = {k: dict(v) if isinstance(v, dict) else v for k, v in extra.items()}
    if family in ("mistral", "mixtral"):  # windowed attention unless told not to
        extra.setdefault("sliding_window", None)
    if family == "mixtral":
        extra.setdefault("num_local_experts", 4)
        extra.setdefault("num_experts_per_tok", 2)
    return FAMILIES[family][0](
        vocab_size=vocab, hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
        tie_word_embeddings=tied, rms_norm_eps=1e-5, attn_implementation="sdpa",
        rope_theta=extra.pop("rope_theta", 1000.0), bos_token_id=None, eos_token_id=None,
        pad_token_id=None, **extra)


def save_random_llama(folder: Path, seed: int = 0, dtype: torch.dtype = torch.float64,
                      max_shard_size: str = "20KB", family: str = "llama", **shape) -> Path:
    """A random LlamaForCausalLM (or `family`'s model) saved with save_pretrained
    (several shards)."""
    torch.manual_seed(seed)
    model = FAMILIES[family][1](llama_config(family=family, **shape)).to(dtype)
    with torch.no_grad():  # norms away from 1 so a mixed-up norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):  # biases away from 0 so a misplaced one shows
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _router_forward(self, hidden_states: torch.Tensor):
    """Mixtral's router with its softmax in the input's dtype (transformers: float32)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    top, indices = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), indices


def _rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor):
    dim = self.inv_freq.shape[0] * 2
    theta = self.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = position_ids[..., None].to(torch.float64) * inv_freq.to(x.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


@contextlib.contextmanager
def transformers_in_float64():
    """transformers' norms and rotary embeddings (Llama's, Mistral's, Qwen2's,
    Mixtral's) and Mixtral's router without their float32 casts."""
    saved = [(norm.forward, rotary.forward) for norm, rotary in _FLOAT32_STEPS]
    router = modeling_mixtral.MixtralTopKRouter
    saved_router = router.forward
    for norm, rotary in _FLOAT32_STEPS:
        norm.forward, rotary.forward = _norm_forward, _rotary_forward
    router.forward = _router_forward
    try:
        yield
    finally:
        for (norm, rotary), (norm_fwd, rotary_fwd) in zip(_FLOAT32_STEPS, saved):
            norm.forward, rotary.forward = norm_fwd, rotary_fwd
        router.forward = saved_router


def hf_logits(folder: Path, tokens: torch.Tensor, float64: bool = True) -> torch.Tensor:
    """transformers' logits for `tokens` from the model saved in `folder`."""
    ctx = transformers_in_float64() if float64 else contextlib.nullcontext()
    with ctx:
        # Mixtral's experts as transformers' own loop: its grouped GEMM takes no float64.
        experts = {"experts_implementation": "eager"} if json.loads(
            (Path(folder) / "config.json").read_text()).get("num_local_experts") else {}
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float64 if float64 else torch.float32,
            attn_implementation="sdpa", **experts)
        with torch.no_grad():
            return model(tokens).logits
